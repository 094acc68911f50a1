"""`scripts/setup.sh` refuses a level it does not know before touching anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_unknown_setup_level_is_refused_with_the_choices(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
        timeout=60, check=False,
        env={**os.environ, "PLUGSERVE_SETUP": "tests", "PLUGSERVE_VENV": str(venv)},
    )
    assert out.returncode == 2
    assert "PLUGSERVE_SETUP=tests is not one of: run, all" in out.stderr
    assert not venv.exists()
