"""``effitrain train``: options -> TrainConfig -> train() -> report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from effitrain.cli.errors import user_errors
from effitrain.config import default_for as D
from effitrain.config import help_for, option
from effitrain.models import PRESETS

if TYPE_CHECKING:
    from effitrain.config import TrainConfig

_PRESETS_HELP = "; ".join(f"[bold]{name}[/]: {desc}" for name, (desc, _) in PRESETS.items())

MODEL, DATA, OPTIM, LOOP, OUT = "Model and data", "Data", "Optimizer", "Loop", "Output"
LEVERS = "Memory levers"


PER_OPTIMIZER = ("lr", "scheduler", "warmup_ratio")
"""Options whose default depends on the optimizer and on fine-tuning versus training from scratch."""

DEFAULT_TEXT = {"max_grad_norm": "1.0; 0 with --optimizer-in-backward"}
"""What --help shows as the default of options whose default depends on other options."""

METAVARS = {
    "model": "NAME|DIR",
    "dataset": "NAME|PATH",
    "dataset_config": "NAME",
    "train_file": "FILE",
    "validation_file": "FILE",
    "task": "NAME",
    "sample_prompt": "TEXT",
    "text_columns": "COL[,COL]",
    "label_column": "COL",
    "optim": "NAME",
    "scheduler": "linear|cosine|constant",
    "mixed_precision": "no|fp16|bf16",
    "output_dir": "DIR",
    "save_strategy": "steps|epoch|no",
    "resume": "latest|DIR",
    "metrics_json": "FILE",
    "report_to": "NAME[,NAME]",
    "weights_dtype": "fp32|bf16",
    "lora_target_modules": "NAME[,NAME]",
}
"""What a value looks like, where the type alone (``<str>``) says little."""


def _opt(
    name: str, panel: str, extra: str = "", flag: str | None = None, **kwargs: object
) -> typer.models.OptionInfo:
    """The option for config field ``name``: its flag and help text come from the config; the
    parameter's default (``D(name)``) is the config's, so --help shows it. ``flag``: a
    ``--on/--off`` pair for a setting whose default depends on the data."""
    per_optimizer = "per optimizer, see effitrain optimizers" if name in PER_OPTIMIZER else None
    if flag is not None and D(name) is None:
        per_optimizer = "per data format"
    return typer.Option(
        flag or option(name),
        help=help_for(name) + extra,
        rich_help_panel=panel,
        show_default=per_optimizer or DEFAULT_TEXT.get(name) or True,
        # A flag takes no value: no type tag.
        metavar="" if isinstance(D(name), bool) or flag else METAVARS.get(name),
        **kwargs,
    )


def train(
    ctx: typer.Context,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="YAML file of options (keys as below, e.g. batch_size: 16); "
            "options given here override it.",
            rich_help_panel=OUT,
        ),
    ] = None,
    task: Annotated[str | None, _opt("task", MODEL)] = None,
    model: Annotated[str, _opt("model", MODEL, f" Presets: {_PRESETS_HELP}.")] = D("model"),
    dataset: Annotated[str, _opt("dataset", MODEL)] = D("dataset"),
    dataset_config: Annotated[str | None, _opt("dataset_config", MODEL)] = None,
    train_file: Annotated[str | None, _opt("train_file", MODEL)] = None,
    validation_file: Annotated[str | None, _opt("validation_file", MODEL)] = None,
    text_columns: Annotated[
        str | None, _opt("text_columns", MODEL, " Comma-separated: sentence1,sentence2.")
    ] = None,
    label_column: Annotated[str | None, _opt("label_column", MODEL)] = None,
    max_length: Annotated[int, _opt("max_length", MODEL)] = D("max_length"),
    packing: Annotated[bool | None, _opt("packing", MODEL, flag="--packing/--no-packing")] = None,
    completion_only_loss: Annotated[
        bool | None,
        _opt("completion_only_loss", MODEL, flag="--completion-only-loss/--full-loss"),
    ] = None,
    sample_prompt: Annotated[str | None, _opt("sample_prompt", MODEL)] = None,
    optim: Annotated[str, _opt("optim", OPTIM)] = D("optim"),
    lr: Annotated[float | None, _opt("lr", OPTIM)] = None,
    weight_decay: Annotated[float, _opt("weight_decay", OPTIM)] = D("weight_decay"),
    scheduler: Annotated[str | None, _opt("scheduler", OPTIM)] = None,
    warmup_ratio: Annotated[float | None, _opt("warmup_ratio", OPTIM)] = None,
    warmup_steps: Annotated[int | None, _opt("warmup_steps", OPTIM)] = None,
    max_grad_norm: Annotated[float | None, _opt("max_grad_norm", OPTIM)] = None,
    fp32_embedding_state: Annotated[bool, _opt("fp32_embedding_state", OPTIM)] = D(
        "fp32_embedding_state"
    ),
    epochs: Annotated[int, _opt("epochs", LOOP)] = D("epochs"),
    max_steps: Annotated[int | None, _opt("max_steps", LOOP)] = None,
    batch_size: Annotated[int, _opt("batch_size", LOOP)] = D("batch_size"),
    eval_batch_size: Annotated[int | None, _opt("eval_batch_size", LOOP)] = None,
    grad_accum: Annotated[int, _opt("grad_accum", LOOP)] = D("grad_accum"),
    mixed_precision: Annotated[str, _opt("mixed_precision", LOOP)] = D("mixed_precision"),
    seed: Annotated[int, _opt("seed", LOOP)] = D("seed"),
    log_every: Annotated[int, _opt("log_every", LOOP)] = D("log_every"),
    gradient_checkpointing: Annotated[bool, _opt("gradient_checkpointing", LEVERS)] = D(
        "gradient_checkpointing"
    ),
    optimizer_in_backward: Annotated[bool, _opt("optimizer_in_backward", LEVERS)] = D(
        "optimizer_in_backward"
    ),
    weights_dtype: Annotated[str, _opt("weights_dtype", LEVERS)] = D("weights_dtype"),
    lora_rank: Annotated[int | None, _opt("lora_rank", LEVERS)] = None,
    lora_alpha: Annotated[float | None, _opt("lora_alpha", LEVERS)] = None,
    lora_dropout: Annotated[float | None, _opt("lora_dropout", LEVERS)] = None,
    lora_target_modules: Annotated[
        str | None, _opt("lora_target_modules", LEVERS, " Comma-separated: query,value.")
    ] = None,
    lora_merge: Annotated[bool, _opt("lora_merge", LEVERS)] = D("lora_merge"),
    output_dir: Annotated[str | None, _opt("output_dir", OUT)] = None,
    save_every: Annotated[int | None, _opt("save_every", OUT)] = None,
    save_strategy: Annotated[str, _opt("save_strategy", OUT)] = D("save_strategy"),
    save_total_limit: Annotated[int | None, _opt("save_total_limit", OUT)] = None,
    resume: Annotated[str | None, _opt("resume", OUT)] = None,
    metrics_json: Annotated[str | None, _opt("metrics_json", OUT)] = None,
    report_to: Annotated[
        str | None, _opt("report_to", OUT, " Comma-separated: tensorboard,wandb.")
    ] = None,
    memory_breakdown: Annotated[
        bool, _opt("memory_breakdown", OUT, flag="--memory-breakdown/--no-memory-breakdown")
    ] = D("memory_breakdown"),
    quiet: Annotated[bool, _opt("quiet", OUT)] = D("quiet"),
) -> None:
    """Train a classifier and report what the optimizer state really costs.

    With no options: the built-in tiny model on the built-in demo data, offline, in under a minute.
    """
    # Only options given on the command line override the YAML file; the parameters' defaults
    # are TrainConfig's own (shown by --help).
    # (By name: typer bundles its own click, whose ParameterSource is not click's.)
    given = ("COMMANDLINE", "ENVIRONMENT")
    overrides = {
        name: value
        for name, value in ctx.params.items()
        if name != "config_file" and getattr(ctx.get_parameter_source(name), "name", "") in given
    }
    with user_errors():
        from effitrain.build import checked_config

        config = checked_config(config_file, overrides)
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
    import logging

    import datasets
    import transformers

    # bitsandbytes warns about an optional 4-bit CPU kernel when imported, which happens
    # whenever peft is installed (transformers imports it, and it imports bitsandbytes).
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Likewise torchao (transformers imports it when installed): CUDA-only kernels it cannot
    # load on a CPU build, and a torch pytree deprecation notice about two of its enums.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's 'Writing model shards'
