"""``effitrain train``: options -> TrainConfig -> loop.train -> report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from effitrain.cli import app, user_errors
from effitrain.config import help_for
from effitrain.models import PRESETS

_PRESETS_HELP = "; ".join(f"[bold]{name}[/]: {desc}" for name, (desc, _) in PRESETS.items())

MODEL, DATA, OPTIM, LOOP, OUT = "Model and data", "Data", "Optimizer", "Loop", "Output"


def _opt(name: str, panel: str, extra: str = "", **kwargs: object) -> typer.models.OptionInfo:
    flag = "--" + name.replace("_", "-")
    return typer.Option(flag, help=help_for(name) + extra, rich_help_panel=panel, **kwargs)


@app.command("train")
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


def run(config) -> None:  # noqa: ANN001 - TrainConfig, imported lazily
    """Train, print the results, write the metrics JSON."""
    _quiet_libraries()
    from effitrain.loop import TrainingStopped
    from effitrain.loop import train as train_loop
    from effitrain.report import Reporter, write_metrics_json

    try:
        result = train_loop(config)
    except TrainingStopped as stop:
        # A signal stopped the run; the loop saved a checkpoint and said how to resume.
        raise typer.Exit(stop.exit_code) from None
    from accelerate import PartialState

    state = PartialState()
    reporter = Reporter(enabled=state.is_main_process, quiet=config.quiet)
    reporter.finished(result)
    if config.metrics_json and state.is_main_process:
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
