"""``effitrain compare``: optimizers and levers side by side, measured, with a picture."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from effitrain.cli.errors import user_errors
from effitrain.cli.train import LOOP, MODEL, _opt
from effitrain.config import default_for as D
from effitrain.config import option

RUNS = "Runs"


def compare(
    optim: Annotated[
        str | None,
        typer.Option(
            "--optim",
            help="Optimizers to compare, comma-separated (default, with no --variant: adamw, "
            "adafactor, adamw-8bit: the course's comparison).",
            metavar="NAME[,NAME]",
            rich_help_panel=RUNS,
        ),
    ] = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(
            "--variant",
            help="A configuration: an optimizer, then +options of effitrain train, e.g. "
            "'adafactor +gradient-checkpointing' or 'adamw +lora-rank=8'. Repeatable.",
            metavar="'NAME +OPTION[=VALUE] ...'",
            rich_help_panel=RUNS,
        ),
    ] = None,
    output_dir: Annotated[
        Path,
        typer.Option(
            "--output-dir",
            help="Where compare.json, compare.csv, compare.png and each run's metrics go.",
            rich_help_panel=RUNS,
        ),
    ] = Path("effitrain-compare"),
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            min=1,
            help="Runs per configuration, in turn (A B C A B C).",
            rich_help_panel=RUNS,
        ),
    ] = 1,  # fmt: skip
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            min=1,
            help="Optimizer steps per run (default 10; or give --epochs).",
            rich_help_panel=RUNS,
        ),
    ] = None,  # fmt: skip
    epochs: Annotated[
        int | None, typer.Option("--epochs", min=1, help="Epochs per run.", rich_help_panel=RUNS)
    ] = None,
    task: Annotated[str | None, _opt("task", MODEL)] = None,
    model: Annotated[
        str, _opt("model", MODEL, " Here the default is the distilbert-base preset.")
    ] = "distilbert-base",
    dataset: Annotated[str, _opt("dataset", MODEL)] = D("dataset"),
    dataset_config: Annotated[str | None, _opt("dataset_config", MODEL)] = None,
    train_file: Annotated[str | None, _opt("train_file", MODEL)] = None,
    validation_file: Annotated[str | None, _opt("validation_file", MODEL)] = None,
    text_columns: Annotated[str | None, _opt("text_columns", MODEL)] = None,
    label_column: Annotated[str | None, _opt("label_column", MODEL)] = None,
    max_length: Annotated[int, _opt("max_length", MODEL)] = D("max_length"),
    batch_size: Annotated[int, _opt("batch_size", LOOP, " Here the default is 8.")] = 8,
    seed: Annotated[int, _opt("seed", LOOP)] = D("seed"),
) -> None:
    """Run several optimizers or levers on the same model and data, each in a fresh process,
    and show each memory part, peak memory, time per step and loss side by side.

    With no options: the course's comparison (AdamW, Adafactor, 8-bit AdamW) on the
    distilbert-base shape, offline, in a few minutes on a laptop CPU.
    """
    with user_errors():
        from effitrain.compare import compare as run_compare
        from effitrain.compare import configurations, plotting_available, write_files
        from effitrain.errors import EffitrainError

        if steps is not None and epochs is not None:
            raise EffitrainError("give --steps or --epochs, not both")
        rows = configurations(
            [n.strip() for n in (optim or "").split(",") if n.strip()], variant or []
        )
        common = _train_args(
            model=model,
            dataset=dataset,
            max_length=max_length,
            task=task,
            dataset_config=dataset_config,
            train_file=train_file,
            validation_file=validation_file,
            text_columns=text_columns,
            label_column=label_column,
            batch_size=batch_size,
            seed=seed,
            log_every=1,
        )
        common += ["--epochs", str(epochs)] if epochs else ["--max-steps", str(steps or 10)]
        from rich.console import Console

        console = Console(highlight=False, stderr=True)
        console.print(
            f"Comparing {len(rows)} configurations on {model}, {repeats} run(s) each, "
            f"one fresh process per run: {', '.join(r.label for r in rows)}"
        )
        comparison = run_compare(rows, common, output_dir, repeats, progress=console.print)
        if not comparison.rows:
            raise EffitrainError(
                "no configuration ran: "
                + "; ".join(f"{k}: {v}" for k, v in comparison.failed.items())
            )
        written = write_files(comparison, output_dir, common)
        _print_table(comparison.rows)
        out = Console(highlight=False)
        out.print("Wrote " + ", ".join(str(p) for p in written.values()))
        if not plotting_available():
            out.print("note: no compare.png: install matplotlib (pip install 'effitrain[plot]')")
        for label, error in comparison.failed.items():
            out.print(f"[red]failed[/]: {label}: {error}")
        if comparison.failed:
            raise typer.Exit(1)


def _train_args(**options: Any) -> list[str]:
    """``effitrain train`` options every run shares: ``--flag value`` for each one given."""
    args: list[str] = []
    for name, value in options.items():
        if value is not None:
            args += [option(name), str(value)]
    return args


def _print_table(rows: list[dict[str, Any]]) -> None:
    """One column per configuration (fits 80 columns for the usual three), ratios to the first."""
    from rich.console import Console
    from rich.table import Table

    from effitrain.compare import COLUMNS
    from effitrain.memory.ledger import format_bytes

    base = rows[0]
    table = Table(
        title=f"Compared (ratios to {base['label']}; memory parts: each one's peak in one step)",
        title_justify="left",
    )
    table.add_column("what")
    for row in rows:
        table.add_column(row["label"].replace(" +", "\n+"), justify="right")
    for label, key in COLUMNS:
        if all(row[key] is None for row in rows):
            continue  # eval accuracy for a causal LM, perplexity for a classifier
        cells = []
        for row in rows:
            value, ref = row[key], base[key]
            if value is None:
                cells.append("-")
                continue
            if key.endswith("bytes"):
                shown = format_bytes(value)
            elif key == "seconds_per_step":
                shown = f"{value:.2f}"
            else:
                shown = f"{value:.3f}"
            if row is not base and ref and (key.endswith("bytes") or key == "seconds_per_step"):
                shown += f" ({value / ref:.2f}×)"
            cells.append(shown)
        table.add_row(label, *cells)
    Console(highlight=False).print(table)
