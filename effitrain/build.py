"""Build a run's components in order: checks → accelerator → data → model → plan → optimizer →
scheduler → ``accelerator.prepare``. The result, a :class:`Run`, is everything the loop needs.

Nothing here trains or prints: notes for the user go through the reporter that the CLI made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import effitrain.checkpoint as checkpoint
import effitrain.distributed as distributed
import effitrain.levers as levers
import effitrain.optim as optim
import effitrain.tasks as tasks
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.memory import ledger
from effitrain.models import load_tokenizer
from effitrain.optim import Hyperparameters, OptimizerSpec, bf16
from effitrain.results import RunInfo
from effitrain.tasks.base import ModelLoss
from effitrain.tasks.sources import steps_per_epoch
from effitrain.models import base_model

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
    def from_config(cls, config: TrainConfig, num_batches: int, warmup_ratio: float) -> Plan:
        """``num_batches``: micro-batches per epoch on this process; ``warmup_ratio``: the
        resolved one (the optimizer's default where not given), used without --warmup-steps.

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
            else math.ceil(total * warmup_ratio)
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
    task: tasks.Task
    data: Any
    """The task's raw data (``classification.LoadedData`` or ``lm_data.LMData``)."""
    hyper: Hyperparameters
    spec: OptimizerSpec
    tokenizer: Any = None
    loss: Any = field(default_factory=ModelLoss)
    """How a micro-batch's loss is computed (the task's ``loss_function``)."""
    info: RunInfo | None = None
    sharding: distributed.Sharding | None = None
    activation_offload: Any = None
    """--activation-offload: the context around forward and backward (``host_bytes`` counts
    what it moved); None without the lever."""


def checked_config(
    config_file: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """:func:`effitrain.config.build_config` (defaults <- YAML <- options), then
    :func:`check_config`: a config every check has passed, the CLI's way in.

    Raises:
        EffitrainError: one line naming the key or option.
    """
    from effitrain.config import build_config

    return check_config(build_config(config_file, overrides))


def check_config(config: TrainConfig) -> TrainConfig:
    """The checks that need the presets, the optimizer registry or the levers (the config's own
    ran when it was made), in one place, before anything is loaded.

    Raises:
        EffitrainError: one line naming the option.
    """
    tasks.check_options(config)
    optim.check_options(config)
    levers.check_options(config)
    return config


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


def accumulation_plugin(grad_accum: int) -> Any:
    """Accelerate's accumulation settings for the loop: ``grad_accum`` micro-batches per step,
    grouped by the loop itself (:func:`effitrain.loop.step_batches` reads a step's batches
    ahead to weigh its tokens), so the dataloader's end must not decide when to sync."""
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False)


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
            gradient_accumulation_plugin=accumulation_plugin(config.grad_accum),
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
    # What FSDP/DeepSpeed would do to this optimizer: refuse or note it before any data or
    # model is loaded.
    for note in distributed.optimizer_notes(accelerator.state, bf16.optimizer_spec(config).name):
        reporter.note(note)
    run = build_task(config, accelerator, reporter)
    run.sharding = distributed.detect_sharding(accelerator.state)
    if run.sharding.kind == "deepspeed":
        distributed.configure_deepspeed(accelerator.state, config.batch_size, config.grad_accum)

    run.spec = optim.for_sharding(run.spec, run.sharding.dtensor_params)
    optimizer = configured_optimizer(config, run.model, run.spec, run.hyper.lr)
    # Accelerate's prepared scheduler steps once per process on every optimizer step, so its
    # lengths are counted in process-steps.
    n = accelerator.num_processes
    lr_scheduler = optim.build_scheduler(
        optimizer, run.hyper.scheduler, run.plan.total_steps * n, run.plan.warmup_steps * n
    )
    run.model, run.optimizer, run.lr_scheduler = accelerator.prepare(
        run.model, optimizer, lr_scheduler
    )
    if config.optimizer_in_backward:
        run.optimizer.optimizer.check_hooked(accelerator.unwrap_model(run.model))
    run.activation_offload = levers.activation_offload(config, accelerator.unwrap_model(run.model))
    run.info = describe(run)
    return run


def build_task(config: TrainConfig, accelerator: Accelerator, reporter: Reporter) -> Run:
    """The task's data, tokenizer, model (with its levers) and prepared dataloaders, and the
    plan and hyperparameters that follow from them; no optimizer yet."""
    # The main process goes first so it alone fills the datasets cache.
    with accelerator.main_process_first():
        task = tasks.resolve_task(config)
        data = task.load_data(config)
    tokenizer = load_tokenizer(config.model)
    model = task.load_model(config, data, tokenizer)
    task.check_model(config, data, model)
    model = levers.apply_to_model(model, config, accelerator.device)
    sharding = distributed.detect_sharding(accelerator.state)
    sharded = sharding.description if sharding.sharded else None
    loss = task.loss_function(config, model, accelerator.device, sharded)
    with accelerator.main_process_first():
        pad_to_multiple_of = 8 if config.mixed_precision != "no" else None
        train_loader, eval_loader = task.dataloaders(config, data, tokenizer, pad_to_multiple_of)
    for note in getattr(data, "notes", []):
        reporter.note(note)
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)
    hyper = optim.resolve_hyperparameters(config)
    return Run(
        config=config,
        accelerator=accelerator,
        model=model,
        optimizer=None,
        lr_scheduler=None,
        train_loader=train_loader,
        eval_loader=eval_loader,
        plan=Plan.from_config(config, len(train_loader), hyper.warmup_ratio),
        task=task,
        data=data,
        hyper=hyper,
        spec=bf16.optimizer_spec(config),  # the registry's, or its bf16 variant
        tokenizer=tokenizer,
        loss=loss,
    )


def configured_optimizer(config: TrainConfig, model: Any, spec: OptimizerSpec, lr: float) -> Any:
    """``spec``'s optimizer over ``model`` with the run's lr, weight decay and lever
    (``effitrain estimate`` builds the same one)."""
    return optim.build_optimizer(
        model,
        spec.name,
        lr,
        config.weight_decay,
        spec=spec,
        in_backward=config.optimizer_in_backward,
        fp32_embedding_state=config.fp32_embedding_state,
        offload=config.optimizer_offload,
    )


def describe(run: Run) -> RunInfo:
    """What the run is about to do, for the banner."""
    config, accelerator, data, plan, hyper = (
        run.config,
        run.accelerator,
        run.data,
        run.plan,
        run.hyper,
    )
    n = accelerator.num_processes
    return RunInfo(
        task=run.task.name,
        model=config.model,
        model_class=type(base_model(accelerator.unwrap_model(run.model))).__name__,
        parameters=ledger.trainable_parameter_count(run.model),
        dataset=data.source,
        train_examples=len(data.train),
        validation_examples=len(data.validation),
        validation_source=data.validation_source,
        data_line=run.task.data_line(data, run.train_loader),
        optimizer=run.spec.name,
        optimizer_class=run.spec.class_path,
        lr=hyper.lr,
        lr_note=hyper.lr_note,
        scheduler=hyper.scheduler,
        warmup_steps=plan.warmup_steps,
        schedule_note=hyper.schedule_note,
        total_steps=plan.total_steps,
        epochs=plan.epochs,
        steps_per_epoch=plan.steps_per_epoch,
        global_batch_size=config.batch_size * config.grad_accum * n,
        device=str(accelerator.device),
        num_processes=n,
        mixed_precision=accelerator.mixed_precision,
        levers=[
            *levers.describe(config, accelerator.unwrap_model(run.model)),
            *run.loss.describe(),
        ],
        optimizer_split=getattr(
            getattr(run.optimizer, "optimizer", run.optimizer), "split_description", ""
        ),
    )
