"""`plugserve plugins`: what each plugin registers, its capabilities, and the failures."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from plugserve.cli.errors import reported_errors
from plugserve.cli.options import DebugOpt, JsonOpt, PluginOpt, print_json

if TYPE_CHECKING:
    from plugserve.plugins import PluginHost


def plugins_command(
    all_: Annotated[
        bool, typer.Option("--all", help="Also list installed plugins that were not loaded.")
    ] = False,
    json_out: JsonOpt = False,
    plugin: PluginOpt = None,
    debug: DebugOpt = False,
) -> None:
    """List plugins: what each registers, its capabilities, and the ones that failed."""
    with reported_errors(debug):
        from plugserve.plugins import load_plugins

        host = load_plugins(plugin or [], strict=False)
        document = plugins_document(host, include_skipped=all_)
        if json_out:
            print_json(document)
        else:
            print_plugins(document)
        if debug:
            for failure in host.failures:
                if failure.detail:
                    typer.echo(failure.detail.rstrip(), err=True)
        host.raise_for_conflicts()


def plugins_document(host: PluginHost, *, include_skipped: bool) -> dict[str, Any]:
    from plugserve.registry import PAGE_TREE_WHITELIST

    entries = host.registries.all_entries()
    rows: list[dict[str, Any]] = []
    for info in host.plugins:
        own = [e for e in entries if e.plugin == info.name]
        rows.append(
            {
                "name": info.name,
                "status": "loaded",
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "kinds": sorted({e.kind for e in own}),
                "hooks": info.hooks,
                "registers": [
                    {
                        "kind": e.kind,
                        "name": e.name,
                        "description": e.description,
                        "capabilities": e.capabilities_dict(),
                        "notes": list(getattr(e.capabilities, "notes", ())),
                        **(
                            {"page_tree_whitelisted": e.page_tree_allowed(),
                             "unavailable": e.unavailable_reason()}
                            if e.kind == "attention backend"
                            else {}
                        ),
                    }
                    for e in own
                ],
            }
        )
    for failure in host.failures:
        rows.append(
            {
                "name": failure.name,
                "status": "failed",
                "distribution": failure.distribution,
                "stage": failure.stage,
                "error": failure.error,
            }
        )
    if include_skipped:
        for skipped in host.skipped:
            rows.append(
                {
                    "name": skipped.name,
                    "status": "skipped",
                    "distribution": skipped.distribution,
                    "version": skipped.version,
                    "reason": skipped.reason,
                }
            )
    return {
        "plugins": rows,
        "page_tree_whitelist": [{"distribution": dist, "name": name}
                                for dist, name in PAGE_TREE_WHITELIST],
        "conflicts": list(host.conflicts),
    }


def print_plugins(document: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    plugins_table = Table("plugin", "distribution", "version", "status", "hooks", title="plugins")
    registered = Table("kind", "name", "plugin", "capabilities", "description", title="registered")
    for row in document["plugins"]:
        status = {
            "loaded": "[green]loaded[/]",
            "failed": f"[red]failed at {row.get('stage')}: {escape(str(row.get('error')))}[/]",
            "skipped": f"[yellow]not loaded: {escape(str(row.get('reason')))}[/]",
        }[row["status"]]
        hooks = "\n".join(h.removeprefix("plugserve_") for h in row.get("hooks", []))
        plugins_table.add_row(
            row["name"], row["distribution"] or "-", row.get("version", "-"), status, hooks
        )
        for entry in row.get("registers", []):
            # An attention backend's "page>1+topk>1" comes from the whitelist (registry).
            caps = ", ".join(f"{k}={_cap(v)}" for k, v in entry["capabilities"].items())
            # Notes (e.g. "not verified on a GPU yet") qualify the capabilities they follow.
            notes = "".join(f"\nnote: {note}" for note in entry.get("notes", []))
            if entry.get("unavailable"):
                notes += f"\nunavailable here: {entry['unavailable']}"
            registered.add_row(
                entry["kind"],
                entry["name"],
                row["name"],
                escape(caps),
                escape(entry["description"] + notes),
            )
    console.print(plugins_table)
    console.print(registered)
    console.print("page_size>1 with topk>1 is allowed only for: " + ", ".join(
        f"{e['name']} ({e['distribution']})" for e in document["page_tree_whitelist"]))


def _cap(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return "|".join(str(v) for v in value)
    return str(value)
