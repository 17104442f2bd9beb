"""``effitrain train``: options -> TrainConfig -> train() -> report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from effitrain.cli.errors import user_errors
from effitrain.config import help_for, option
from effitrain.models import PRESETS

if TYPE_CHECKING:
    from effitrain.config import TrainConfig

_PRESETS_HELP = "; ".join(f"[bold]{name}[/]: {desc}" for name, (desc, _) in PRESETS.items())

MODEL, DATA, OPTIM, LOOP, OUT = "Model and data", "Data", "Optimizer", "Loop", "Output"


def _opt(name: str, panel: str, extra: str = "", **kwargs: object) -> typer.models.OptionInfo:
    """The option for config field ``name``: its flag and help text come from the config."""
    return typer.Option(option(name), help=help_for(name) + extra, rich_help_panel=panel, **kwargs)


def train(
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="YAML file of options (keys as below, e.g. batch_size: 16); "
            "options given here override it.",
            rich_help_panel=OUT,
        ),
    ] = None,
    model: Annotated[str | None, _opt("model", MODEL, f" Presets: {_PRESETS_HELP}.")] = None,
    dataset: Annotated[str | None, _opt("dataset", MODEL)] = None,
    dataset_config: Annotated[str | None, _opt("dataset_config", MODEL)] = None,
    train_file: Annotated[str | None, _opt("train_file", MODEL)] = None,
    validation_file: Annotated[str | None, _opt("validation_file", MODEL)] = None,
    text_columns: Annotated[
        str | None, _opt("text_columns", MODEL, " Comma-separated: sentence1,sentence2.")
    ] = None,
    label_column: Annotated[str | None, _opt("label_column", MODEL)] = None,
    max_length: Annotated[int | None, _opt("max_length", MODEL)] = None,
    optim: Annotated[str | None, _opt("optim", OPTIM)] = None,
    lr: Annotated[float | None, _opt("lr", OPTIM)] = None,
    weight_decay: Annotated[float | None, _opt("weight_decay", OPTIM)] = None,
    scheduler: Annotated[str | None, _opt("scheduler", OPTIM)] = None,
    warmup_ratio: Annotated[float | None, _opt("warmup_ratio", OPTIM)] = None,
    warmup_steps: Annotated[int | None, _opt("warmup_steps", OPTIM)] = None,
    max_grad_norm: Annotated[float | None, _opt("max_grad_norm", OPTIM)] = None,
    epochs: Annotated[int | None, _opt("epochs", LOOP)] = None,
    max_steps: Annotated[int | None, _opt("max_steps", LOOP)] = None,
    batch_size: Annotated[int | None, _opt("batch_size", LOOP)] = None,
    eval_batch_size: Annotated[int | None, _opt("eval_batch_size", LOOP)] = None,
    grad_accum: Annotated[int | None, _opt("grad_accum", LOOP)] = None,
    mixed_precision: Annotated[str | None, _opt("mixed_precision", LOOP)] = None,
    seed: Annotated[int | None, _opt("seed", LOOP)] = None,
    log_every: Annotated[int | None, _opt("log_every", LOOP)] = None,
    output_dir: Annotated[str | None, _opt("output_dir", OUT)] = None,
    save_every: Annotated[int | None, _opt("save_every", OUT)] = None,
    save_strategy: Annotated[str | None, _opt("save_strategy", OUT)] = None,
    save_total_limit: Annotated[int | None, _opt("save_total_limit", OUT)] = None,
    resume: Annotated[str | None, _opt("resume", OUT)] = None,
    metrics_json: Annotated[str | None, _opt("metrics_json", OUT)] = None,
    quiet: Annotated[bool | None, _opt("quiet", OUT)] = None,
) -> None:
    """Train a classifier and report what the optimizer state really costs.

    With no options: the built-in tiny model on the built-in demo data, offline, in under a minute.
    """
    overrides = {
        name: value
        for name, value in locals().items()
        if name != "config_file" and value is not None
    }
    with user_errors():
        from effitrain.config import build_config

        config = build_config(config_file, overrides)
        run(config)


def run(config: TrainConfig) -> None:
    """Train with the run's one reporter, print the results, write the metrics JSON."""
    _quiet_libraries()
    from effitrain.report import Reporter, write_metrics_json
    from effitrain.signals import TrainingStopped
    from effitrain.train import train

    reporter = Reporter(quiet=config.quiet)
    try:
        result = train(config, reporter)
    except TrainingStopped as stop:
        # A signal stopped the run; it saved a checkpoint and said how to resume.
        raise typer.Exit(stop.exit_code) from None
    reporter.finished(result)
    if config.metrics_json and reporter.enabled:  # enabled: the main process
        write_metrics_json(config.metrics_json, result.to_dict())
        reporter.saved_metrics(config.metrics_json)


def _quiet_libraries() -> None:
    """Keep library chatter (dataset map bars, info logs) out of the training output."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's 'Writing model shards'
