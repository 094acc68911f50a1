"""`plugserve conformance`: run the attention-backend conformance suite on one backend."""

from __future__ import annotations

from typing import Annotated

import typer

from plugserve.cli.errors import reported_errors
from plugserve.cli.options import DebugOpt


def conformance_command(
    attention: Annotated[
        str, typer.Option("--attention", metavar="NAME", help="Registered attention backend.")
    ],
    device: Annotated[
        str | None,
        typer.Option(help="cpu or cuda[:N] (default: cpu if the backend declares it, else "
                     "cuda). A device missing here skips the suite with the reason."),
    ] = None,
    keyword: Annotated[
        str | None,
        typer.Option("-k", "--keyword", metavar="EXPR", help="Only tests matching this pytest "
                     "-k expression (e.g. 'Kernel and not bf16')."),
    ] = None,
    smoke: Annotated[
        bool, typer.Option(help="A few representative cases only (for slow backends).")
    ] = False,
    pytest_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="[-- PYTEST_ARGS]", help="Passed on to pytest, after --."),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Run the conformance suite on one attention backend; non-zero exit on any failure.

    Tests need the capabilities the backend registered: what it does not declare is skipped
    with the reason. See docs/backends.md.
    """
    with reported_errors(debug):
        from plugserve.plugins import get_plugin_host

        get_plugin_host().registries.attention.get(attention)  # unknown: lists the names
        from plugserve.testing.conformance.runner import run_suite

        code = run_suite(attention, device=device, keyword=keyword, smoke=smoke,
                         pytest_args=pytest_args or ())
    if code != 0:
        raise typer.Exit(code)
