"""Throughput of two revisions, measured side by side in one run.

    python benchmarks/compare_revisions.py BASE_REV [--new NEW_REV] [--rounds 3] [-- bench options]

Checks out BASE_REV (and NEW_REV, or else uses this working tree) into temporary git
worktrees, makes each one's packages importable ahead of the editable install, and runs
`plugserve bench throughput --json` alternately (base, new, base, new, ...), so load from
anything else on the machine falls on both. Prints each run's output tok/s and the ratio
new / base of the medians. Everything the runs share (model, workload, seed, threads) comes
from the same options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _base_path(worktree: Path, into: Path) -> str:
    """A folder of symlinks that imports the base's `plugserve` and plugin packages."""
    (into / "plugserve").symlink_to(worktree / "core")
    for package in sorted((worktree / "plugins").glob("*/plugserve_*")):
        if package.is_dir() and (package / "__init__.py").exists():
            (into / package.name).symlink_to(package)
    return str(into)


def _bench(python_path: str | None, bench_args: list[str]) -> float:
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = python_path + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from plugserve.cli import main; sys.argv[0] = 'plugserve'; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "bench", "throughput", "--json", *bench_args],
        env=env, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir(),
    )
    document = json.loads(out.stdout)
    runs = document["runs"] if "runs" in document else [document]
    return float(runs[0]["output_tok_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--new", help="the revision to measure (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1 :]  # after --: options for `plugserve bench throughput`
    revisions = {"base": args.base, "new": args.new}
    with tempfile.TemporaryDirectory() as tmp:
        paths: dict[str, str | None] = {"new": None}
        trees: list[Path] = []
        try:
            for name, rev in revisions.items():
                if rev is None:
                    continue
                tree = Path(tmp) / name
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                                str(tree), rev], check=True, capture_output=True)
                trees.append(tree)
                links = Path(tmp) / f"{name}-path"
                links.mkdir()
                paths[name] = _base_path(tree, links)
            results: dict[str, list[float]] = {"base": [], "new": []}
            for i in range(args.rounds):
                for name in ("base", "new"):
                    results[name].append(_bench(paths[name], bench_args))
                    print(f"round {i + 1} {name}: {results[name][-1]:.1f} out tok/s", flush=True)
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], check=False, capture_output=True)
    base, new = statistics.median(results["base"]), statistics.median(results["new"])
    print(f"median out tok/s: base {base:.1f}, new {new:.1f}; ratio new/base {new / base:.3f}")


if __name__ == "__main__":
    main()
