"""The real `plugserve` executable and `python -m plugserve`, in a subprocess.

Uses the dummy plugins (on PYTHONPATH): install them first with
`bash tests/dummy_plugins/install.sh`; generate needs plugserve-checker installed too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dummy_site

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "plugserve"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dummy_site.subprocess_env(**(env or {})),
    )


def test_help_works_with_a_broken_plugin_installed() -> None:
    assert SCRIPT.is_file(), f"console script missing: {SCRIPT} (pip install -e .)"
    done = run(str(SCRIPT), "--help")
    assert done.returncode == 0, done.stderr
    for command in ("generate", "plugins", "bench"):
        assert command in done.stdout
    assert done.stderr == ""
    done = run(str(SCRIPT), "generate", "--help")
    assert done.returncode == 0 and "--plugin" in done.stdout


def test_plugins_json_through_python_m() -> None:
    done = run(
        sys.executable, "-m", "plugserve", "plugins", "--json", "--plugin", "no:duplicate_name"
    )
    assert done.returncode == 0, done.stderr
    by_name = {row["name"]: row for row in json.loads(done.stdout)["plugins"]}
    assert by_name["good"]["distribution"] == "plugserve-dummy-good"
    assert by_name["broken_import"]["status"] == "failed"


def test_error_is_one_line_and_debug_adds_the_traceback() -> None:
    done = run(str(SCRIPT), "generate", "hi", "--plugin", "duplicate_name")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning:")]
    assert errors == [
        "error: attention backend 'torch_native' is registered twice: by plugin 'builtin' "
        "(plugserve 0.1.0) and by plugin 'duplicate_name' (plugserve-dummy-duplicate-name "
        "0.1.0); uninstall one, or disable it with --plugin no:duplicate_name"
    ]
    assert "Traceback" not in done.stderr
    done = run(str(SCRIPT), "generate", "hi", "--plugin", "duplicate_name", "--debug")
    assert done.returncode == 1
    assert "Traceback (most recent call last):" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: attention backend 'torch_native'")


def test_generate_end_to_end(tiny_model_dir: Path) -> None:
    done = run(
        str(SCRIPT),
        "generate",
        "hello",
        "--model",
        str(tiny_model_dir),
        "--json",
        "--max-new-tokens",
        "4",
        "--mem-check",
        "1",
        env={"PLUGSERVE_PLUGINS": "checker"},
    )
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)["results"]
    assert result["output_tokens"] == 4 and result["error"] is None


def test_importing_the_cli_imports_nothing_heavy() -> None:
    code = (
        "import sys, plugserve.cli; "
        "heavy = [m for m in ('torch', 'plugserve.engine', 'plugserve.plugins', "
        "'plugserve.bench', 'plugserve.config') if m in sys.modules]; "
        "print(heavy)"
    )
    done = run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
