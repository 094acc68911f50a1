"""One line from a `plugserve bench --json` file: output tok/s and median TTFT of each run.

Used by scripts/gpu_check.sh so its summary table shows the bench figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def bench_line(path: Path) -> str:
    document = json.loads(path.read_text())
    config = document["config"]
    runs = [
        f"{run['name']} {run['output_tok_per_s']:.0f} output tok/s, "
        f"TTFT median {1000 * run['ttft_s']['median']:.0f} ms"
        for run in document["runs"]
    ]
    return f"{config['attention']} {config['dtype']} page {config['page_size']}: " + "; ".join(runs)


if __name__ == "__main__":
    print(bench_line(Path(sys.argv[1])))
