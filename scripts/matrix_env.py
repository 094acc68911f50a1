"""Give a fresh virtual environment exactly the third-party distributions some requirements
declare, transitively, by linking them from the environment this runs in (the project's
`.venv`, where `make setup` installed everything). Nothing is downloaded or copied, so a test
session per plugin costs seconds, and a plugin that imports a package it does not declare
fails in its own session.

Used by noxfile.py; the plugserve distributions themselves are installed editable there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


@dataclass
class LinkedSite:
    base: Path  # the site-packages the links point into
    linked: int = 0  # third-party distributions linked
    local: list[str] = field(default_factory=list)  # plugserve distributions reached


def declared_closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution `requirements` reach through their declared
    dependencies (markers evaluated, extras followed), by canonical name."""
    found: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    stack = [Requirement(r) for r in requirements]
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        first_visit = name not in found
        new_extras = set(req.extras) - extras_seen.get(name, set())
        if not first_visit and not new_extras:
            continue
        try:
            dist = found.get(name) or metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{req.name} (needed for {', '.join(requirements)}) is not installed in "
                f"{sys.prefix}: run `make setup` first") from None
        found[name] = dist
        extras_seen.setdefault(name, set()).update(new_extras)
        # The plain dependencies once, then those of each extra asked for the first time.
        environments = ([""] if first_visit else []) + sorted(new_extras)
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None:
                if first_visit:
                    stack.append(dep)
            elif any(dep.marker.evaluate({"extra": extra}) for extra in environments):
                stack.append(dep)
    return found


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names directly in site-packages that a distribution installed."""
    if dist.files is None:
        raise SystemExit(f"{dist.metadata['Name']} has no RECORD: cannot tell its files")
    return {f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}


def link_declared_dependencies(venv: Path, requirements: list[str], *, local: set[str],
                               alone: tuple[str, ...] = ()) -> LinkedSite:
    """Symlink into `venv`'s site-packages every third-party distribution the closure of
    `requirements` holds, and each distribution in `alone` without its dependencies (the
    build backend, or a package that only ships data, such as the default model's GGUF);
    return the distributions named in `local` that the closure reached (the caller installs
    those from source). The venv must not hold copies of its own of any of them."""
    closure = declared_closure(requirements)
    for name in alone:
        closure.setdefault(canonicalize_name(name), metadata.distribution(name))
    local_names = {canonicalize_name(n) for n in local}
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"
    base: Path | None = None
    site = LinkedSite(base=Path())
    for name, dist in sorted(closure.items()):
        if name in local_names:
            site.local.append(dist.metadata["Name"])
            continue
        origin = Path(str(dist.locate_file("")))
        base = base or origin
        for entry in _top_level_entries(dist):
            link = target / entry
            if not link.exists() and not link.is_symlink():
                link.symlink_to(origin / entry)
        site.linked += 1
    site.base = base or target
    return site
