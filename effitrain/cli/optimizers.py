"""``effitrain optimizers``: the registry as a table."""

from __future__ import annotations

import typer


def optimizers(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
) -> None:
    """List the optimizers: library, default lr, state kept, bytes per parameter, availability."""
    from effitrain.optim import OPTIMIZERS

    rows = [
        {
            "name": spec.name,
            "class": spec.class_path,
            "default_lr": spec.default_lr,
            "state": spec.state,
            "bytes_per_param": spec.bytes_per_param,
            "available": spec.is_available(),
            "install": spec.install,
            "description": spec.description,
        }
        for spec in OPTIMIZERS.values()
    ]
    if as_json:
        import json

        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Optimizers (--optim NAME)", title_justify="left")
    for column in ("name", "class", "default lr", "state kept", "bytes/param", "available"):
        table.add_column(column, justify="right" if column == "default lr" else "left")
    for row in rows:
        available = "[green]yes[/]" if row["available"] else f"[red]no[/]: {row['install']}"
        table.add_row(
            row["name"],
            row["class"],
            f"{row['default_lr']:g}",
            row["state"],
            row["bytes_per_param"],
            available,
        )
    console = Console(highlight=False)
    console.print(table)
    console.print("bytes/param: optimizer-state bytes per fp32 parameter of a large 2-D weight.")
