"""Offline throughput benchmark: the same as `plugserve bench` (see plugserve.bench).

python benchmarks/throughput.py [--model PATH] [--compare transformers] [--json] ...
The other workloads run the same way: `python benchmarks/throughput.py shared-prefix ...`
is `plugserve bench shared-prefix ...`.
"""

from __future__ import annotations

import sys

from plugserve.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["bench"]
    main()
