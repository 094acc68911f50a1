"""`python -m plugserve.kernels`: build the CPU kernels now (or find them built) and say so.

`scripts/setup.sh` runs it in the background while pip installs the rest of the project, so a
first `make run` does not compile at its first engine start. It needs only torch and this
package (nothing else is imported), shows plain progress lines on stderr (pip writes to the
same terminal) and exits 0 once the library loads, 1 with the reason where it cannot be had
here (the engine then says the same at start and runs its torch paths).
"""

from __future__ import annotations

import sys

from plugserve.kernels import build, compile, isa, status  # noqa: F401 (all imported up front)


def main() -> int:
    reason = "prepared during setup for the first start"
    library = build.prepare(status.LineStatus(reason))
    if library is None:
        print(f"plugserve: CPU kernels not built: {build.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"plugserve: CPU kernels ready ({', '.join(library.built)}): {library.path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
