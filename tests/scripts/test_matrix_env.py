"""The test matrix's environments (scripts/matrix_env.py, used by noxfile.py): a session gets
exactly the declared closure of what it installs; every plugin declares its test extra."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from matrix_env import declared_closure, link_declared_dependencies  # noqa: E402


def test_closure_follows_declared_dependencies_and_extras() -> None:
    plain = declared_closure(["plugserve-checker"])
    assert {"plugserve", "plugserve-checker", "torch", "pluggy", "transformers"} <= set(plain)
    assert "pytest" not in plain and "triton" not in plain  # nobody in it declares them
    with_tests = declared_closure(["plugserve-checker[test]"])
    assert {"pytest", "openai", "httpx"} <= set(with_tests)  # through plugserve[test]


def test_a_missing_distribution_says_what_to_run() -> None:
    with pytest.raises(SystemExit, match=r"no-such-dist.*make setup"):
        declared_closure(["no-such-dist"])


def test_links_the_closure_and_reports_the_local_distributions(tmp_path: Path) -> None:
    site = tmp_path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"
    site.mkdir(parents=True)
    linked = link_declared_dependencies(tmp_path, ["plugserve-checker"],
                                        local={"plugserve", "plugserve-checker"})
    assert sorted(linked.local) == ["plugserve", "plugserve-checker"]
    assert (site / "torch").is_symlink() and (site / "pluggy").is_symlink()
    assert not (site / "plugserve_checker").exists()  # installed from source by the session
    assert not (site / "pytest").exists()


def test_every_plugin_declares_a_test_extra_on_the_core_test_tools() -> None:
    folders = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))
    assert len(folders) >= 5
    for folder in folders:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        assert "plugserve[test]" in project["optional-dependencies"]["test"], folder
