"""``effitrain inspect-state``: what is inside a checkpoint's optimizer state (read safely)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from effitrain.cli.error_handling import user_errors


def inspect_state(
    path: Annotated[
        Path,
        typer.Argument(
            help="An effitrain checkpoint folder, an accelerate save_state folder, a Trainer "
            "checkpoint folder, an output folder with checkpoint-* folders, or a torch.save file.",
            metavar="PATH",
            show_default=False,
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of tables.")
    ] = False,
    top: Annotated[
        int,
        typer.Option("--top", metavar="N", help="How many of the largest per-parameter states."),
    ] = 10,
) -> None:
    """Show the optimizer state in a checkpoint: keys, sizes, the largest states, AdamW's cost.

    Files are never unpickled with code execution: only torch.save zip archives are read, with
    weights_only=True, after checking which globals they would import.
    """
    with user_errors():
        from effitrain.errors import EffitrainError
        from effitrain.inspection import inspect_state as read_state

        if top < 1:
            raise EffitrainError(f"--top must be 1 or more (got {top})")
        report = read_state(path)
        if as_json:
            import json

            typer.echo(json.dumps(report.to_dict(top=top), indent=2))
            return
        from effitrain.report.state_tables import print_state_report

        print_state_report(report, top)
