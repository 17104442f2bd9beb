"""Build a run's components in order: accelerator → data → model → plan → optimizer → scheduler
→ ``accelerator.prepare``. The result, a :class:`Run`, is everything the loop needs.

Nothing here trains or prints: notes for the user go through the reporter that the CLI made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import effitrain.checkpoint as checkpoint
import effitrain.distributed as distributed
import effitrain.levers as levers
import effitrain.memory as memory
import effitrain.precision as precision
from effitrain.config import TrainConfig
from effitrain.data import build_dataloaders, load_data, steps_per_epoch
from effitrain.errors import EffitrainError
from effitrain.models import (
    CAUSAL_LM,
    CAUSAL_PRESETS,
    SEQUENCE_CLASSIFICATION,
    load_causal_lm,
    load_model,
    load_tokenizer,
    model_task,
)
from effitrain.optim import OptimizerSpec, build_optimizer, build_scheduler
from effitrain.results import RunInfo
from effitrain.wrapped import base_model

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from effitrain.report import Reporter


@dataclass(frozen=True)
class Plan:
    """How long the run is, in optimizer steps on each process."""

    steps_per_epoch: int
    total_steps: int
    epochs: int
    warmup_steps: int

    @classmethod
    def from_config(cls, config: TrainConfig, num_batches: int) -> Plan:
        """``num_batches``: micro-batches per epoch on this process.

        Raises:
            EffitrainError: the training set yields no optimizer step.
        """
        per_epoch = steps_per_epoch(num_batches, config.grad_accum)
        if per_epoch == 0:
            raise EffitrainError(
                "the training set yields no batches; check --batch-size and the data"
            )
        total = config.max_steps or per_epoch * config.epochs
        warmup = (
            config.warmup_steps
            if config.warmup_steps is not None
            else math.ceil(total * config.effective_warmup_ratio)
        )
        return cls(per_epoch, total, math.ceil(total / per_epoch), warmup)

    @property
    def measured_step(self) -> int:
        """The optimizer step (0-based) whose memory is broken down by kind: the last, or the one
        before it where the last ends an epoch (its batch can be the epoch's short remainder)
        and the epoch has another, but never the first step of a longer run: optimizers create
        their state in their first step, so its backward runs without it and under-states every
        later step. Why late in the run: ``effitrain.loop._measure_now``."""
        last = self.total_steps - 1
        if self.total_steps % self.steps_per_epoch == 0 and self.steps_per_epoch > 1 and last > 1:
            return last - 1
        return last


@dataclass
class Run:
    """The prepared components of one run, and what describes it."""

    config: TrainConfig
    accelerator: Accelerator
    model: Any
    optimizer: Any
    lr_scheduler: Any
    train_loader: DataLoader
    eval_loader: DataLoader
    plan: Plan
    num_labels: int
    """0 for causal-lm."""
    spec: OptimizerSpec | None = None
    tokenizer: Any = None
    info: RunInfo | None = None
    sharding: distributed.Sharding | None = None
    task: str = SEQUENCE_CLASSIFICATION


def check_outputs(config: TrainConfig) -> None:
    """Fail before training, not after it, when results could not be written or would mix
    with an earlier run's checkpoints."""
    if config.metrics_json:
        parent = Path(config.metrics_json).expanduser().resolve().parent
        existing = next(p for p in (parent, *parent.parents) if p.exists())
        if not existing.is_dir():
            raise EffitrainError(
                f"--metrics-json {config.metrics_json}: {existing} is not a folder"
            )
    if config.output_dir and not config.resume:
        latest = checkpoint.find_latest(config.output_dir)
        if latest is not None:
            raise EffitrainError(
                f"{config.output_dir} already holds checkpoints (newest: {latest.name}); "
                "continue that run with --resume latest, or choose another --output-dir"
            )


def build_accelerator(config: TrainConfig) -> Accelerator:
    import time

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    tracking: dict[str, Any] = {}
    if config.trackers:
        # --report-to: Accelerate's trackers; the ones that write files locally write here.
        logging_dir = (
            Path(config.output_dir, "runs")
            if config.output_dir
            else Path("runs", time.strftime("%Y%m%d-%H%M%S"))
        )
        tracking = {
            "log_with": config.trackers,
            "project_config": ProjectConfiguration(logging_dir=str(logging_dir)),
        }
    try:
        return Accelerator(
            # Several launched processes and no GPU: CPU processes over gloo (see distributed.py).
            cpu=distributed.cpu_for_launch(),
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.grad_accum,
            # A seedable sampler makes data order depend only on (seed, epoch), on every rank.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            **tracking,
        )
    except (ValueError, RuntimeError) as exc:
        raise EffitrainError(
            f"--mixed-precision {config.mixed_precision} is not available here: {exc}"
        ) from exc


def build_run(config: TrainConfig, reporter: Reporter) -> Run:
    """Build and prepare everything, in order; refuse what cannot work before it is built.

    Raises:
        EffitrainError: a user-fixable problem (data, model, optimizer, options, launch).
    """
    import torch
    from accelerate.utils import set_seed

    accelerator = build_accelerator(config)
    reporter.enabled = accelerator.is_main_process
    set_seed(config.seed)
    if accelerator.num_processes == 1 and torch.cuda.device_count() > 1:
        reporter.note(
            f"{torch.cuda.device_count()} GPUs are visible but this run uses one; to use them all: "
            "accelerate launch --multi_gpu -m effitrain train ..."
        )

    levers.check_launch(config, accelerator.state)
    # The main process goes first so it alone fills the datasets cache.
    with accelerator.main_process_first():
        task = resolve_task(config)
        config.check_causal_options(task)
        data = load_task_data(config, task)
    tokenizer = load_tokenizer(config.model)
    if task == CAUSAL_LM:
        from effitrain.lm_data import check_packing

        model = load_causal_lm(config.model, tokenizer)
        check_packing(data, model.config.model_type, config)
    else:
        model = load_model(config.model, data.num_labels, data.label_names, tokenizer)
    model = levers.apply_to_model(model, config)
    with accelerator.main_process_first():
        train_loader, eval_loader = build_task_dataloaders(
            task,
            data,
            tokenizer,
            config,
            pad_to_multiple_of=8 if config.mixed_precision != "no" else None,
        )
    for note in getattr(data, "notes", []):
        reporter.note(note)
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)
    plan = Plan.from_config(config, len(train_loader))

    # What FSDP/DeepSpeed would do to this optimizer: refuse or note it before anything is built.
    spec = precision.optimizer_spec(config)  # the registry's, or its bf16 variant
    for note in distributed.optimizer_notes(accelerator.state, spec.name):
        reporter.note(note)
    sharding = distributed.detect_sharding(accelerator.state)
    if sharding.kind == "deepspeed":
        distributed.configure_deepspeed(accelerator.state, config.batch_size, config.grad_accum)

    optimizer, lr_scheduler = build_optimization(config, model, spec, plan, accelerator)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    if config.optimizer_in_backward:
        optimizer.optimizer.check_hooked(accelerator.unwrap_model(model))

    return Run(
        config=config,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        train_loader=train_loader,
        eval_loader=eval_loader,
        plan=plan,
        num_labels=getattr(data, "num_labels", 0),
        spec=spec,
        tokenizer=tokenizer,
        info=describe(config, accelerator, model, data, plan, optimizer, task, train_loader),
        sharding=sharding,
        task=task,
    )


def resolve_task(config: TrainConfig) -> str:
    """``--task``, else the model's: a preset's own task; for a hub or folder causal LM,
    causal-lm unless the data has a label column (a decoder can classify too).

    Raises:
        EffitrainError: the model's config or the data cannot be read.
    """
    if config.task is not None:
        return config.task
    task = model_task(config.model)
    if task != CAUSAL_LM or config.model in CAUSAL_PRESETS:
        return task or SEQUENCE_CLASSIFICATION
    if config.label_column is not None:
        return SEQUENCE_CLASSIFICATION
    if config.uses_builtin_data:
        return SEQUENCE_CLASSIFICATION  # the built-in demo is labelled sentence pairs
    from effitrain.data import _load_splits
    from effitrain.lm_data import LM_FORMATS, has_label_column

    splits, _ = _load_splits(config, formats=LM_FORMATS)  # .txt files too
    first = splits.get("train") or next(iter(splits.values()))
    return SEQUENCE_CLASSIFICATION if has_label_column(first.column_names) else CAUSAL_LM


def load_task_data(config: TrainConfig, task: str) -> Any:
    """The task's raw splits: ``LoadedData`` (classification) or ``lm_data.LMData``."""
    if task == CAUSAL_LM:
        from effitrain.lm_data import load_lm_data

        return load_lm_data(config)
    return load_data(config)


def build_task_dataloaders(
    task: str, data: Any, tokenizer: Any, config: TrainConfig, pad_to_multiple_of: int | None
) -> tuple[DataLoader, DataLoader]:
    """Tokenized training and evaluation loaders for the task."""
    if task == CAUSAL_LM:
        from effitrain.lm_data import build_lm_dataloaders

        return build_lm_dataloaders(data, tokenizer, config, pad_to_multiple_of)
    return build_dataloaders(data, tokenizer, config, pad_to_multiple_of=pad_to_multiple_of)


def configured_optimizer(config: TrainConfig, model: Any, spec: OptimizerSpec) -> Any:
    """``spec``'s optimizer over ``model`` with the run's lr, weight decay and lever
    (``effitrain estimate`` builds the same one)."""
    return build_optimizer(
        model,
        spec.name,
        config.effective_lr,
        config.weight_decay,
        spec=spec,
        in_backward=config.optimizer_in_backward,
        fp32_embedding_state=config.fp32_embedding_state,
    )


def build_optimization(
    config: TrainConfig, model: Any, spec: OptimizerSpec, plan: Plan, accelerator: Accelerator
) -> tuple[Any, Any]:
    """The optimizer (one per parameter with --optimizer-in-backward) and its lr scheduler."""
    optimizer = configured_optimizer(config, model, spec)
    # Accelerate's prepared scheduler steps once per process on every optimizer step, so its
    # lengths are counted in process-steps.
    n = accelerator.num_processes
    lr_scheduler = build_scheduler(
        optimizer, config.effective_scheduler, plan.total_steps * n, plan.warmup_steps * n
    )
    return optimizer, lr_scheduler


def describe(
    config: TrainConfig,
    accelerator: Accelerator,
    model: Any,
    data: Any,
    plan: Plan,
    optimizer: Any = None,
    task: str = SEQUENCE_CLASSIFICATION,
    train_loader: Any = None,
) -> RunInfo:
    """What the run is about to do, for the banner (``optimizer``: built, possibly prepared;
    ``data``: ``LoadedData`` or, for causal-lm, ``lm_data.LMData``)."""
    spec = precision.optimizer_spec(config)
    n = accelerator.num_processes
    if task == CAUSAL_LM:
        columns, label_column, num_labels = data.columns, "", 0
        sequences = len(train_loader.dataset) if train_loader is not None else 0
        lm = {
            "data_format": data.format,
            "packing": data.packing,
            "completion_only": data.completion_only,
            "train_sequences": sequences,
        }
    else:
        columns, label_column, num_labels = data.text_columns, data.label_column, data.num_labels
        lm = {}
    return RunInfo(
        task=task,
        **lm,
        model=config.model,
        model_class=type(base_model(accelerator.unwrap_model(model))).__name__,
        parameters=memory.trainable_parameter_count(model),
        dataset=data.source,
        train_examples=len(data.train),
        validation_examples=len(data.validation),
        validation_source=data.validation_source,
        text_columns=columns,
        label_column=label_column,
        num_labels=num_labels,
        optimizer=spec.name,
        optimizer_class=spec.class_path,
        lr=config.effective_lr,
        lr_note=config.default_note("lr"),
        scheduler=config.effective_scheduler,
        warmup_steps=plan.warmup_steps,
        # Named only when neither the schedule nor the warmup was given.
        schedule_note=config.default_note("scheduler")
        if config.scheduler is None and config.warmup_ratio is None and config.warmup_steps is None
        else "",
        total_steps=plan.total_steps,
        epochs=plan.epochs,
        steps_per_epoch=plan.steps_per_epoch,
        global_batch_size=config.batch_size * config.grad_accum * n,
        device=str(accelerator.device),
        num_processes=n,
        mixed_precision=accelerator.mixed_precision,
        levers=levers.describe(config, accelerator.unwrap_model(model)),
        optimizer_split=getattr(
            getattr(optimizer, "optimizer", optimizer), "split_description", ""
        ),
    )
