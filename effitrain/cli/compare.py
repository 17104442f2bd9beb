"""``effitrain compare``: optimizers and levers side by side, measured, with a picture."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from effitrain.cli.error_handling import user_errors
from effitrain.cli.optimizers import short_number
from effitrain.cli.options import PRESET_NAMES, config_fields, config_options, given_values, panels
from effitrain.cli.quiet import quiet_libraries
from effitrain.config import OUTPUT, to_arguments
from effitrain.levers import LEVERS

if TYPE_CHECKING:
    from effitrain.comparison import Comparison, Configuration

RUNS = "Runs"

DEFAULTS: dict[str, Any] = {"model": "distilbert-base", "batch_size": 8, "max_steps": 10}
"""compare's own defaults: distilbert-base's shape (real-size memory), and runs short enough to
compare several."""

DEFAULT_COMPARISON_LR = {"adamw": 3e-5, "adafactor": 3e-4, "adamw-8bit": 3e-5}
"""The default comparison's learning rates, with half its steps warming up: its three optimizers
train the random-init distilbert-base shape stably at these. Their defaults for
training from scratch suit the small presets; at this size the first full step diverges."""

NOT_SHARED = (
    *("optim", "log_every", "sample_prompt", *panels()[OUTPUT]),
    *(name for lever in LEVERS.values() for name in lever.save_only),
)
"""Train options that compare sets itself (each run's optimizer, its metrics and loss log) or
that change nothing it shows (checkpoints, the final save, trackers, printed samples)."""


Optims = Annotated[
    str | None,
    typer.Option(
        "--optim",
        help="Optimizers to compare, comma-separated (default, with no --variant: adamw, "
        "adafactor, adamw-8bit).",
        metavar="NAME[,NAME]",
        rich_help_panel=RUNS,
    ),
]
Variants = Annotated[
    list[str] | None,
    typer.Option(
        "--variant",
        help="A configuration: an optimizer, then +options of effitrain train, e.g. "
        "'adafactor +gradient-checkpointing' or 'adamw +lora-rank=8'. Repeatable.",
        metavar="'NAME +OPTION[=VALUE] ...'",
        rich_help_panel=RUNS,
    ),
]
OutputDir = Annotated[
    Path,
    typer.Option(
        "--output-dir",
        help="Where compare.json, compare.csv, compare.png and each run's metrics go.",
        metavar="DIR",
        rich_help_panel=RUNS,
    ),
]
Repeats = Annotated[
    int,
    typer.Option(
        "--repeats",
        help="Runs per configuration, in turn (A B C A B C); time per step is their median.",
        metavar="N",
        rich_help_panel=RUNS,
    ),
]


@config_options(
    exclude=NOT_SHARED,
    defaults=DEFAULTS,
    default_text={"epochs": "--max-steps 10 instead"},
    extra_help={"model": PRESET_NAMES},
)
def compare(
    optim: Optims = None,
    variant: Variants = None,
    output_dir: OutputDir = Path("effitrain-compare"),
    repeats: Repeats = 1,
    *,
    overrides: dict[str, Any],
) -> None:
    """Compare optimizers or memory levers on one model: memory, time and loss side by side.

    Each configuration trains in a fresh `effitrain train` process with the options given here;
    the table shows each memory part, the peaks, the time per step and the losses, and
    compare.png draws the memory bars and the loss curves.

    With no options: AdamW, Adafactor and 8-bit AdamW on the
    distilbert-base shape (65.8M parameters, random init), batch 8, 10 steps, at learning rates
    that train it stably from scratch (adamw 3e-5, adafactor 3e-4, adamw-8bit 3e-5; half the
    steps warm up); a few minutes on a laptop CPU, offline. Other optimizers, another model or
    --lr: each optimizer's own defaults (see effitrain optimizers).
    """
    with user_errors():
        quiet_libraries()  # checking the configurations imports what they use
        from effitrain.comparison import write_files
        from effitrain.report.comparison_table import print_comparison

        default = _is_default_comparison(optim, variant, overrides)
        common = shared_arguments(overrides, default)
        rows = _configurations(optim, variant, common, repeats, default)
        comparison = _run(rows, common, output_dir, repeats, _model(overrides))
        written = write_files(comparison, output_dir, common)
        print_comparison(comparison.rows, written, comparison.failed)
        if comparison.failed:
            raise typer.Exit(1)


def _is_default_comparison(
    optim: str | None, variants: list[str] | None, overrides: dict[str, Any]
) -> bool:
    """Whether this is the default comparison, which runs at :data:`DEFAULT_COMPARISON_LR`: its
    optimizers on the default model, no learning rate given."""
    return (
        not optim
        and not variants
        and _model(overrides) == DEFAULTS["model"]
        and ("lr" not in overrides)
    )


def _configurations(
    optim: str | None,
    variants: list[str] | None,
    common: list[str],
    repeats: int,
    default: bool = False,
) -> list[Configuration]:
    """The rows to run (at :data:`DEFAULT_COMPARISON_LR` for the default comparison), each checked before
    any runs."""
    from effitrain.comparison import Configuration, configurations
    from effitrain.errors import EffitrainError

    if repeats < 1:
        raise EffitrainError(f"--repeats must be 1 or more (got {repeats})")
    names = [name.strip() for name in (optim or "").split(",") if name.strip()]
    rows = configurations(names, variants or [])
    if default:
        lrs = {name: short_number(lr) for name, lr in DEFAULT_COMPARISON_LR.items()}
        rows = [Configuration(row.label, [*row.args, "--lr", lrs[row.label]]) for row in rows]
    for row in rows:
        check_configuration(row, common)
    return rows


def _run(
    rows: list[Configuration], common: list[str], output_dir: Path, repeats: int, model: str
) -> Comparison:
    """Every run, with progress lines on stderr; at least one configuration must run."""
    from rich.console import Console

    from effitrain.comparison import compare as run_compare
    from effitrain.errors import EffitrainError

    console = Console(highlight=False, stderr=True)

    def progress(line: str) -> None:
        # whole lines, greppable in logs; text, not markup (an error may name "effitrain[mini]")
        console.print(line, soft_wrap=True, markup=False)

    progress(
        f"Comparing {len(rows)} configurations on {model}, {repeats} run(s) each, one fresh "
        f"process per run: {', '.join(row.label for row in rows)}"
    )
    comparison = run_compare(rows, common, output_dir, repeats, progress=progress)
    if not comparison.rows:
        failures = "; ".join(f"{label}: {error}" for label, error in comparison.failed.items())
        raise EffitrainError(f"no configuration ran: {failures}")
    return comparison


def _model(overrides: dict[str, Any]) -> str:
    return overrides.get("model", DEFAULTS["model"])


def shared_arguments(overrides: dict[str, Any], default: bool = False) -> list[str]:
    """The ``effitrain train`` arguments every run shares: compare's defaults, then the options
    given (``--epochs`` without ``--max-steps`` replaces the default step count), and a loss
    point at every step for the curves. ``default``: the default comparison, which warms up
    over half its steps unless told otherwise."""
    values = {**DEFAULTS, **overrides}
    if "epochs" in overrides and "max_steps" not in overrides:
        del values["max_steps"]
    if default and not {"warmup_ratio", "warmup_steps"} & set(overrides):
        values["warmup_ratio"] = 0.5
    return [*to_arguments(values), "--log-every", "1"]


def train_config(arguments: list[str]) -> Any:
    """The checked :class:`~effitrain.config.TrainConfig` that ``effitrain train ARGUMENTS``
    would run, parsed by the train command itself (benchmarks and tests use it to estimate a
    run's own options).

    Raises:
        EffitrainError: an option does not parse (click's message) or is refused.
    """
    from effitrain.build import checked_config
    from effitrain.cli.error_handling import click_exception, usage_message
    from effitrain.errors import EffitrainError

    try:
        ctx = _train_command().make_context("effitrain train", list(arguments))
    except click_exception() as exc:
        raise EffitrainError(usage_message(exc)) from None
    overrides = given_values(ctx, ctx.params, config_fields())
    return checked_config(ctx.params.get("config_file"), overrides)


@functools.cache
def _train_command() -> Any:
    """The train command as click parses it, built once: typer builds it from the function's
    signature, tens of milliseconds that a comparison or a plan would pay per configuration."""
    from effitrain.cli.train import train

    app = typer.Typer()
    app.command()(train)
    return typer.main.get_command(app)


def check_configuration(row: Configuration, common: list[str]) -> None:
    """Parse and check one run's options as its ``effitrain train`` will, before any run starts,
    so that a typo fails at once with its reason rather than after the other runs.

    Raises:
        EffitrainError: naming the configuration and the reason.
    """
    from effitrain.errors import EffitrainError

    try:
        train_config([*common, *row.args])
    except EffitrainError as exc:
        raise EffitrainError(f"{row.label}: {exc}") from None
