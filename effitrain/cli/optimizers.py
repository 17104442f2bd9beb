"""``effitrain optimizers``: the registry, one short block per optimizer (fits 80 columns)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from effitrain.optim import OptimizerSpec


def _defaults(defaults: Any) -> dict[str, Any]:
    return {
        "lr": defaults.lr,
        "warmup_ratio": defaults.warmup_ratio,
        "scheduler": defaults.scheduler,
    }


def short_number(value: float) -> str:
    """``1e-4`` rather than ``0.0001``."""
    return f"{value:.0e}".replace("e-0", "e-").replace("e+00", "")


def bytes_per_param(spec: OptimizerSpec) -> str:
    """The measured figure and its note: ``2.04 (tensors < 4096 elements keep fp32 state: 8)``."""
    from effitrain.optim import state_bytes_per_param

    figure = state_bytes_per_param(spec.name)
    text = "not measured" if figure is None else f"{figure:.2f}"
    return f"{text} ({spec.state_bytes_note})" if spec.state_bytes_note else text


def optimizers(
    as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON."),
) -> None:
    """List the optimizers: library, defaults, state kept, bytes per parameter, availability."""
    from effitrain.optim import FINE_TUNE, OPTIMIZERS, SCRATCH, measured_state_bytes

    rows = [
        {
            "name": spec.name,
            "class": spec.class_path,
            "defaults": {
                FINE_TUNE: _defaults(spec.fine_tune),
                SCRATCH: _defaults(spec.scratch),
                **({"LoRA": _defaults(spec.lora)} if spec.lora else {}),
            },
            "state": spec.state,
            "bytes_per_param": bytes_per_param(spec),
            "available": spec.is_available(),
            "install": spec.install,
            "description": spec.description,
            "caveat": spec.caveat,
        }
        for spec in OPTIMIZERS.values()
    ]
    if as_json:
        import json

        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)

    def line(text: str) -> None:
        console.print(text, soft_wrap=False)

    line("[bold]Optimizers[/] (--optim NAME), with their defaults for fine-tuning")
    line("(a hub id or a folder) and for training a built-in preset from scratch.")
    for row in rows:
        tune, scratch = row["defaults"][FINE_TUNE], row["defaults"][SCRATCH]
        line("")
        line(f"[bold cyan]{row['name']}[/]  {row['class']}")
        if not row["available"]:  # a line of its own: the command stays whole at 80 columns
            line(f"  [red]not installed[/]: {escape(row['install'])}")
        line(f"  {escape(row['description'])}")
        lora = [("LoRA        ", row["defaults"]["LoRA"])] if "LoRA" in row["defaults"] else []
        for label, defaults in (("fine-tuning ", tune), ("from scratch", scratch), *lora):
            line(
                f"  {label}  lr {short_number(defaults['lr'])}, "
                f"{defaults['warmup_ratio']:.0%} warmup, then {defaults['scheduler']}"
            )
        line(f"  state: {escape(row['state'])}")
        line(f"  bytes/param: {escape(row['bytes_per_param'])}")
        if row["caveat"]:
            line(f"  [yellow]note:[/] {escape(row['caveat'])}")
    measured = measured_state_bytes()["settings"]
    line("")
    line("bytes/param: optimizer-state bytes per trained parameter, measured on the")
    line(f"{measured['model']} preset ({measured['weights']} weights) after one step.")
