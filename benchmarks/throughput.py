"""Offline throughput benchmark: the same as `plugserve bench` (see plugserve.bench).

python benchmarks/throughput.py [--model PATH] [--compare transformers] [--json] ...
"""

from __future__ import annotations

import sys

from plugserve.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["bench"]
    main()
