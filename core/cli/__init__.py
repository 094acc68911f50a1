"""The `plugserve` command line: generate, plugins, bench.

One module per command (`generate`, `plugins_cmd`, `bench`); `errors` turns any error into
one stderr line, `options` holds the shared options and set-up, `logs` the `--log-level`
handling. Nothing heavy is imported at module level: torch, the engine and the plugins load
inside the command that needs them, so `plugserve --help` works even with a broken plugin
installed. Every error a user can cause ends as one line on stderr and exit code 1;
`--debug` adds the traceback.
"""

from __future__ import annotations

import typer

from plugserve.cli.bench import bench_command
from plugserve.cli.chat import chat_command
from plugserve.cli.conformance import conformance_command
from plugserve.cli.generate import generate_command
from plugserve.cli.plugins_cmd import plugins_command
from plugserve.cli.serve import serve_command

__all__ = ["app", "main"]

app = typer.Typer(
    name="plugserve",
    help="A small, pluggable LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("generate")(generate_command)
app.command("chat")(chat_command)
app.command("plugins")(plugins_command)
app.command("bench")(bench_command)
app.command("serve")(serve_command)
app.command("conformance")(conformance_command)


def main() -> None:
    """Console script entry point."""
    app(prog_name="plugserve")
