"""Build a run's components in order, in one pass: checks → accelerator → launch checks → data →
model (loaded, levers applied) → loss → dataloaders → plan → optimizer → scheduler →
``accelerator.prepare``. The result, a :class:`~effitrain.run.Run`, is everything the loop needs.

``effitrain estimate`` builds the same run from the same functions (:func:`check_launch`,
:func:`resolve_task`, :func:`build_model`, :func:`build_loss`, :func:`resolve_optimizer_spec`,
:func:`assemble`), on fake tensors, with stand-ins for what only a real launch has: the data and
the processes.

Nothing here trains or prints: notes for the user go through the reporter that the CLI made.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import effitrain.checkpoint as checkpoint
import effitrain.levers as levers
import effitrain.levers.context_parallel as context_parallel
import effitrain.optim as optim
import effitrain.tasks as tasks
from effitrain.config import TrainConfig
from effitrain.cost import device_name, peak_flops
from effitrain.distributed import WEIGHTS_RECEIVED, Launch, configure_deepspeed, cpu_for_launch
from effitrain.errors import EffitrainError
from effitrain.memory import ledger
from effitrain.models import (
    LoadOptions,
    base_model,
    load_tokenizer,
    materialize_empty,
    sequence_limit,
)
from effitrain.results import RunInfo
from effitrain.run import Plan, Run
from effitrain.tracking import Trackers

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.optim import Hyperparameters, OptimizerSpec
    from effitrain.parts import Loss
    from effitrain.report.live import Reporter
    from effitrain.tasks.base import Task


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
    task = tasks.known_task(config)
    if task is not None:  # else once the model or the data tells (resolve_task)
        levers.check_task(config, task)
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
        final = Path(config.output_dir) / checkpoint.FINAL_DIR
        if final.exists():
            raise EffitrainError(
                f"{config.output_dir} already holds a trained model ({final}); a new run would "
                "replace it: choose another --output-dir (or move it away)"
            )


def check_launch(config: TrainConfig, launch: Launch) -> list[str]:
    """Refuse what the launch rules out (the levers', the optimizer's under its sharding)
    before any data or model is loaded; return the notes on what it changes.

    Raises:
        EffitrainError: one line naming the option and the launch.
    """
    levers.check_launch(config, launch)
    return launch.optimizer_notes(config.optim)


def accumulation_plugin(grad_accum: int) -> Any:
    """Accelerate's accumulation settings for the loop: ``grad_accum`` micro-batches per step,
    grouped by the loop itself (:func:`effitrain.loop.step_batches` reads a step's batches
    ahead to weigh its tokens), so the dataloader's end must not decide when to sync."""
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False)


def build_accelerator(config: TrainConfig, cpu: bool | None = None) -> Accelerator:
    """The run's Accelerator. ``cpu``: force the CPU (an estimate's fake tensors); None: as the
    launch says (several launched processes and no GPU: CPU processes over gloo)."""
    import time

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    tracking: dict[str, Any] = {}
    if config.trackers and cpu is None:
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
            cpu=cpu_for_launch() if cpu is None else cpu,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_plugin=accumulation_plugin(config.grad_accum),
            # A seedable sampler makes data order depend only on (seed, epoch), on every rank.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            # --context-parallel (a run's, not an estimate's): Accelerate's device mesh.
            parallelism_config=context_parallel.parallelism_config(config) if cpu is None else None,
            **tracking,
        )
    except (ValueError, RuntimeError) as exc:
        raise EffitrainError(
            f"--mixed-precision {config.mixed_precision} is not available here: {exc}"
        ) from exc


def resolve_task(config: TrainConfig) -> Task:
    """The run's task, with the options that belong to another task refused (the levers'
    included).

    Raises:
        EffitrainError: the model's config or the data cannot be read, or an option does not fit.
    """
    task = tasks.resolve_task(config)
    levers.check_task(config, task.name)
    return task


def load_options(
    config: TrainConfig, device: torch.device | None, launch: Launch | None = None
) -> LoadOptions:
    """How this process gets the checkpoint's weights: read as the levers say (in the dtype
    they train in, quantized while reading, straight onto a CUDA device where they change how
    it is read), or not read at all where the launch sends it the main process's
    (:attr:`Launch.receives_weights`)."""
    receive = launch.receives_weights if launch is not None else None
    return levers.load_options(config, LoadOptions(receive=receive)).onto(device)


def build_model(
    config: TrainConfig,
    task: Task,
    data: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    device: torch.device | None,
    loaded: bool = True,
    launch: Launch | None = None,
) -> torch.nn.Module:
    """The model to train, levers applied and made ready for ``launch``: loaded as
    :func:`load_options` says (``loaded``), or built from its config alone (an estimate's,
    under the meta device).

    Raises:
        EffitrainError: the model cannot be loaded or cannot take a lever.
    """
    options = load_options(config, device, launch)
    model: torch.nn.Module  # a transformers model until a lever wraps it (LoRA)
    if loaded:
        model = task.load_model(config, data, tokenizer, options)
        task.check_model(config, data, model)
    else:
        model = task.model_from_config(config, data, tokenizer)
    model = levers.apply_to_model(model, config, device)
    if launch is not None:
        levers.for_launch(model, config, launch)
    if loaded and options.receives == "empty":
        materialize_empty(model, device)  # the launch's wrap broadcasts the main process's
    return model


def build_loss(
    config: TrainConfig,
    task: Task,
    model: torch.nn.Module,
    launch: Launch,
    device: torch.device,
) -> Loss:
    """The task's loss for the model (unwrapped, levers applied), on this launch and device."""
    sharded = launch.sharding.description if launch.sharding.sharded else None
    return task.loss_function(model, device, sharded, levers.loss_options(config), config=config)


def resolve_hyperparameters(config: TrainConfig, task: Task) -> Hyperparameters:
    """The lr and schedule: the options', else the optimizer's defaults for this run and task."""
    return optim.resolve_hyperparameters(
        config, adapters=levers.trains_adapters(config), lr_divisor=task.lr_divisor
    )


def resolve_optimizer_spec(config: TrainConfig, launch: Launch) -> OptimizerSpec:
    """The registry's spec for ``--optim``, with the levers' variant (bf16 weights) and the
    sharding's (FSDP2's factored optimizers) in its place, resolved once."""
    spec = levers.optimizer_spec(optim.get_spec(config.optim), config)
    return optim.for_sharding(spec, launch.sharding.dtensor_params)


def build_optimizer(
    config: TrainConfig,
    model: torch.nn.Module,
    spec: OptimizerSpec,
    lr: float,
    estimating: bool = False,
) -> torch.optim.Optimizer:
    """``spec``'s optimizer over ``model``'s trainable parameters with the run's lr and weight
    decay, built by the lever that builds it where one does."""
    return optim.build_optimizer(
        model,
        spec,
        lr,
        config.weight_decay,
        fp32_embedding_state=config.fp32_embedding_state,
        builder=levers.optimizer_builder(config, estimating),
    )


def assemble(
    *,
    config: TrainConfig,
    accelerator: Accelerator,
    launch: Launch,
    task: Task,
    data: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    model: torch.nn.Module,
    loss: Loss,
    train_loader: DataLoader[Any],
    eval_loader: DataLoader[Any],
    plan: Plan,
    trackers: Trackers,
    estimating: bool = False,
    weights: str = "read",
) -> Run:
    """The optimizer, scheduler and the levers' step contexts for a model and its data, prepared
    by Accelerate, put together as the :class:`Run` (a run's, and an estimate's on fake
    tensors, whose model is already where it trains; ``weights``: :attr:`Run.weights`)."""
    hyperparameters = resolve_hyperparameters(config, task)
    spec = resolve_optimizer_spec(config, launch)
    optimizer = build_optimizer(config, model, spec, hyperparameters.lr, estimating)
    # Accelerate's prepared scheduler steps once per process on every optimizer step, so its
    # lengths are counted in process-steps.
    n = accelerator.num_processes
    lr_scheduler = optim.build_scheduler(
        optimizer, hyperparameters.scheduler, plan.total_steps * n, plan.warmup_steps * n
    )
    # Fake parameters are already where they train, and cannot be moved (DeepSpeed refuses any
    # placement list: only an estimate passes one).
    placement = [False, False, False] if estimating else None
    model, optimizer, lr_scheduler = accelerator.prepare(
        model, optimizer, lr_scheduler, device_placement=placement
    )
    run = Run(
        config=config,
        accelerator=accelerator,
        launch=launch,
        task=task,
        data=data,
        tokenizer=tokenizer,
        model=model,
        loss=loss,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        train_loader=train_loader,
        eval_loader=eval_loader,
        plan=plan,
        hyperparameters=hyperparameters,
        optimizer_spec=spec,
        max_grad_norm=levers.max_grad_norm(config),
        trackers=trackers,
        lever_contexts=levers.step_contexts(
            config, accelerator.unwrap_model(model), estimating=estimating
        ),
        weights=weights,
    )
    levers.after_prepare(run)
    loss.after_prepare(run)  # DPO's reference: the model as it starts, before any resume
    return run


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
    launch = Launch.of(accelerator.state)
    for note in check_launch(config, launch):  # before any data or model is loaded
        reporter.note(note)
    if launch.sharding.kind == "deepspeed":
        configure_deepspeed(accelerator.state, config.batch_size, config.grad_accum)
    # The main process goes first so it alone fills the datasets cache.
    with accelerator.main_process_first():
        task = resolve_task(config)
        data = task.load_data(config)
    tokenizer = load_tokenizer(config.model)
    # The tasks cut sequences at the tokenizer's limit: --beyond-positions lifts it.
    tokenizer.model_max_length = sequence_limit(
        config.model, tokenizer.model_max_length, config.max_length, config.beyond_positions
    )
    model = build_model(config, task, data, tokenizer, accelerator.device, launch=launch)
    received = load_options(config, accelerator.device, launch).receives
    loss = build_loss(config, task, model, launch, accelerator.device)
    with accelerator.main_process_first():
        pad_to_multiple_of = 8 if config.mixed_precision != "no" else None
        if context_parallel.size(config) > 1:  # 2N equal chunks of every sequence
            pad_to_multiple_of = math.lcm(
                pad_to_multiple_of or 1, 2 * context_parallel.size(config)
            )
        train_loader, eval_loader = task.dataloaders(config, data, tokenizer, pad_to_multiple_of)
    for note in getattr(data, "notes", []):
        reporter.note(note)
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)
    warmup_ratio = resolve_hyperparameters(config, task).warmup_ratio
    return assemble(
        config=config,
        accelerator=accelerator,
        launch=launch,
        task=task,
        data=data,
        tokenizer=tokenizer,
        model=model,
        loss=loss,
        train_loader=train_loader,
        eval_loader=eval_loader,
        plan=Plan.from_config(config, len(train_loader), warmup_ratio),
        trackers=Trackers(accelerator, config),
        weights=WEIGHTS_RECEIVED if received else "read",
    )


def describe(run: Run) -> RunInfo:
    """What the run is about to do, for the banner."""
    config, accelerator, data, plan = run.config, run.accelerator, run.data, run.plan
    hyperparameters = run.hyperparameters
    unwrapped = accelerator.unwrap_model(run.model)
    inner = ledger.unwrap_prepared(run.optimizer)
    device = device_name(accelerator.device)
    return RunInfo(
        task=run.task.name,
        speed_unit=run.task.speed_unit,
        model=config.model,
        model_class=type(base_model(unwrapped)).__name__,
        parameters=ledger.parameter_count(run.model),
        trainable_parameters=ledger.trainable_parameter_count(run.model),
        dataset=data.source,
        train_examples=len(data.train),
        validation_examples=len(data.validation),
        validation_source=data.validation_source,
        data_line=run.task.data_line(data, run.train_loader),
        optimizer=run.optimizer_spec.name,
        optimizer_class=run.optimizer_spec.class_path,
        lr=hyperparameters.lr,
        lr_note=hyperparameters.lr_note,
        scheduler=hyperparameters.scheduler,
        warmup_steps=plan.warmup_steps,
        schedule_note=hyperparameters.schedule_note,
        total_steps=plan.total_steps,
        epochs=plan.epochs,
        steps_per_epoch=plan.steps_per_epoch,
        # The ranks of a context-parallel group share their batches.
        global_batch_size=config.batch_size
        * config.grad_accum
        * accelerator.num_processes
        // context_parallel.size(config),
        device=str(accelerator.device),
        num_processes=accelerator.num_processes,
        mixed_precision=accelerator.mixed_precision,
        levers=[*levers.banner_lines(config, unwrapped), *run.loss.describe()],
        optimizer_split=getattr(inner, "split_description", ""),
        peak_unknown="" if peak_flops(device) else device,
    )
