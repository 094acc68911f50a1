"""`python -m plugserve` runs the command line."""

from __future__ import annotations

from plugserve.cli import main

if __name__ == "__main__":
    main()
