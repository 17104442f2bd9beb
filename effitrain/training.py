"""One training run, in four stages: build, resume or start fresh, fit, summarize.

::

    run = build_run(config, reporter)          # accelerator, data, model, optimizer, scheduler
    progress = TrainingProgress(...)           # counters; loaded from a checkpoint on --resume
    fit(run, progress, checkpointer, ...)      # the loop (effitrain.loop)
    result = summarize(run, progress, ...)     # what it cost, measured from real storage

With ``--report-to``, Accelerate's trackers follow along (:mod:`effitrain.tracking`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import effitrain.checkpoint as checkpoint
import effitrain.distributed as distributed
import effitrain.levers as levers
import effitrain.optim as optim
import effitrain.tracking as tracking
from effitrain.build import build_run, check_config, check_outputs, describe
from effitrain.config import TrainConfig
from effitrain.cost import device_name, throughput
from effitrain.loop import evaluate, fit
from effitrain.measure import memory_record
from effitrain.memory import ledger
from effitrain.progress import Stopwatch, TrainingProgress
from effitrain.results import TrainResult
from effitrain.run import Run
from effitrain.signals import StoppedAtOnce, StopRequest, TrainingStopped, stop_on_signals
from effitrain.tasks.sources import check_files_exist

if TYPE_CHECKING:
    from effitrain.report.live import Reporter


def train(config: TrainConfig, reporter: Reporter) -> TrainResult:
    """Run one training job as configured and return what it measured.

    The output folder is locked for the run (:func:`effitrain.checkpoint.output_lock`, by the
    main process) before anything is written to it.

    Raises:
        EffitrainError: a user-fixable problem (bad data, model, optimizer, options), or another
            run holds the output folder.
        TrainingStopped: SIGINT/SIGTERM stopped it (after a complete and saved step in the
            loop; at once before it and after it: :func:`stopped_at_once`).
    """
    check_config(config)
    check_files_exist(config)
    reporter.enabled = reporter.enabled and distributed.is_launch_main_process()
    locked = config.output_dir if distributed.is_launch_main_process() else None
    with checkpoint.output_lock(locked, reporter.note), stop_on_signals() as stop:
        with stopped_at_once(stop, reporter, "before training; nothing was saved"):
            run, progress, checkpointer = prepare(config, reporter)
        timer = fit(run, progress, checkpointer, reporter, stop)
        last = checkpointer.last_path
        kept = f"last checkpoint: {last}" if last else "no checkpoint"
        when = f"after its last step ({progress.global_step}), before the run finished; {kept}"
        with stopped_at_once(stop, reporter, when):
            return finish(run, progress, checkpointer, timer, reporter)


@contextmanager
def stopped_at_once(stop: StopRequest, reporter: Reporter, when: str) -> Iterator[None]:
    """Outside the loop there is no step to finish: a signal in the block stops the run at once,
    with one line saying ``when``.

    Raises:
        TrainingStopped: a signal arrived, with its exit code (128 + the signal's number).
    """
    try:
        with stop.at_once():
            yield
    except StoppedAtOnce as signalled:
        reporter.stopped_at_once(signalled.signal_name, when)
        raise TrainingStopped(signalled.exit_code, None) from None


def prepare(
    config: TrainConfig, reporter: Reporter
) -> tuple[Run, TrainingProgress, checkpoint.Checkpointer]:
    """Everything before the first step: the checks, the build, the resume, the loss's work
    before training (DPO's reference pass)."""
    check_outputs(config)
    tracking.check(config)
    resume_notes: list[str] = []
    if config.resume:  # before anything is built: the accumulation shapes the data loaders
        config, resume_notes = continue_checkpoint_run(config)
    if config.max_memory is not None:  # before any weight is read
        from effitrain.budget import check_budget
        from effitrain.config import parse_size
        from effitrain.distributed import launch_from_environment

        budget = parse_size(config.max_memory, "--max-memory")
        check_budget(config, launch_from_environment(), budget)
    run = build_run(config, reporter)
    for note in resume_notes:
        reporter.note(note)
    reporter.run_started(describe(run))
    progress = TrainingProgress.for_accelerator(run.accelerator)
    checkpointer = make_checkpointer(run)
    if config.resume:
        resume(run, progress, checkpointer, reporter)
    run.loss.before_training(run, reporter)  # e.g. DPO's reference pass
    if config.output_dir:  # before training, not after: final/ never goes back to an older model
        checkpoint.check_final(config.output_dir, run.plan.total_steps)
    run.trackers.start(progress.global_step, reporter)
    return run, progress, checkpointer


def finish(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    timer: Stopwatch,
    reporter: Reporter,
) -> TrainResult:
    """After the last step: the final evaluation where it is missing, the final model, the
    summary."""
    config = run.config
    if not progress.eval_history or progress.eval_history[-1]["step"] != progress.global_step:
        # Resumed from a checkpoint saved at the last step but before its evaluation.
        metrics = evaluate(run)
        run.trackers.log_evaluation(metrics, progress.global_step)
        progress.record_evaluation(metrics, epoch_complete=False)
    final_model_dir = None
    optim.set_train_mode(run.optimizer, False)  # schedule-free: save the weights it evaluated
    if config.output_dir:
        final_model_dir = checkpoint.save_final(
            run.accelerator, run.model, run.tokenizer, config.output_dir, progress.global_step
        )
        reporter.saved_final(str(final_model_dir))
    else:
        reporter.not_saved()
    result = summarize(run, progress, timer, checkpointer.last_path, final_model_dir)
    levers.after_final_save(run, reporter)  # after the summary: LoRA's merge changes the model
    run.trackers.finish(result)
    return result


def continue_checkpoint_run(config: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The ``--resume`` run's options as they continue its checkpoint's run on this launch's
    process count (:func:`effitrain.checkpoint.continued_config`), and the notes on what changed."""
    from effitrain.distributed import launch_from_environment

    path, _ = checkpoint.resolve_resume(config.resume, config.output_dir)
    meta = checkpoint.read_metadata(path)
    processes = launch_from_environment().sharding.num_processes
    return checkpoint.continued_config(config, meta, path, processes)


def make_checkpointer(run: Run) -> checkpoint.Checkpointer:
    model = run.accelerator.unwrap_model(run.model)
    names = {id(p): name for name, p in model.named_parameters()}
    return checkpoint.Checkpointer(
        run.accelerator,
        run.config,
        checkpoint.CheckpointPolicy.from_config(
            run.config, run.plan.total_steps, run.plan.steps_per_epoch
        ),
        run.optimizer,
        optimizer_name=run.optimizer_spec.name,
        optimizer_class=run.optimizer_spec.class_path,
        # The optimizer's parameters in its state-dict order (ids 0, 1, …), for inspect-state.
        param_names=[
            names.get(id(p), "?") for group in run.optimizer.param_groups for p in group["params"]
        ],
        parameter_shapes={name: list(p.shape) for name, p in model.named_parameters()},
        lr_scheduler=run.lr_scheduler,
        schedule=schedule_of(run),
        save_extra=functools.partial(run.loss.save_extra, run),
    )


def schedule_of(run: Run) -> dict[str, Any]:
    """The lr schedule the run follows, as checkpoints record it and a resume compares it."""
    hyperparameters, plan = run.hyperparameters, run.plan
    return {
        "lr": hyperparameters.lr,
        "scheduler": hyperparameters.scheduler,
        "warmup_steps": plan.warmup_steps,
        "total_steps": plan.total_steps,
    }


def resume(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
) -> None:
    """Check the ``--resume`` checkpoint against this run, then load it (weights, optimizer,
    scheduler, RNG states, the loop's progress), then check what it loaded before the first
    step; say what was skipped and what is not restored (docs/checkpoints.md)."""
    config, accelerator = run.config, run.accelerator
    path, skipped = checkpoint.resolve_resume(config.resume, config.output_dir)
    for problem in skipped:
        reporter.note(f"{problem}: skipped; resuming from {path.name}")
    meta = checkpoint.read_metadata(path)
    checkpoint.check_step(meta, path)
    checkpoint.check_layout(path, run.launch.strategy == "fsdp")
    checkpoint.check_resumable(
        meta,
        path,
        optimizer_name=checkpointer.optimizer_name,
        optimizer_class=checkpointer.optimizer_class,
        param_groups=run.optimizer.param_groups,
        parameter_shapes=checkpointer.parameter_shapes,
        fp32_embedding_state=config.fp32_embedding_state,
    )
    for note in checkpoint.check_schedule(meta, schedule_of(run), config, path):
        reporter.note(note)
    differences = checkpoint.config_differences(
        meta, config, used=options_as_used, num_processes=accelerator.num_processes
    )
    if differences:
        reporter.note(
            f"options differ from the checkpoint's run ({'; '.join(differences)}): "
            "the resumed run is not an exact continuation"
        )
    levers.check_checkpoint(run, path)
    saved_world = meta.get("world_size") or 1
    unrestored = _random_state_problems(accelerator, path, saved_world)
    if accelerator.num_processes > saved_world:
        last = accelerator.num_processes - 1
        who = (
            f"process {last} has" if last == saved_world else f"processes {saved_world}-{last} have"
        )
        reporter.note(
            f"{who} no random state in a checkpoint of {saved_world} process(es) and starts from "
            "the seed (dropout masks differ from those of the run had it gone on as it was)"
        )
    checkpoint.load_checkpoint(accelerator, path, strict=levers.strict_load(config))
    checkpoint.check_counters(meta, path, run.optimizer, run.lr_scheduler)
    checkpoint.continue_schedule(run.lr_scheduler, meta, accelerator.num_processes)
    run.loss.load_extra(run, path)
    if unrestored:
        reporter.note(
            f"{'; '.join(unrestored)}: the random state is not restored, so this resume is not "
            "an exact continuation (dropout and data order may differ from the original run)"
        )
    saved_accum = (meta.get("config") or {}).get("grad_accum") or 1
    saved_micro_batches = (meta.get("world_size") or 1) * saved_accum
    progress.load_state_dict(
        meta, batch_weight=accelerator.num_processes * config.grad_accum / saved_micro_batches
    )
    checkpointer.last_saved_step = progress.global_step
    reporter.resumed(str(path), progress.global_step, progress.epoch, progress.step_in_epoch)
    if progress.global_step >= run.plan.total_steps:
        reporter.note(
            f"the checkpoint is already at step {progress.global_step} of {run.plan.total_steps}"
        )


def _random_state_problems(accelerator: Any, path: Path, saved_world: int) -> list[str]:
    """Every process's reason its RNG state in ``path`` cannot be restored (Accelerate would go
    on without it, saying nothing), gathered so that the main process can say it; a process
    the checkpoint's run did not have is said apart."""
    problem = None
    if accelerator.process_index < saved_world:
        problem = checkpoint.random_state_problem(path, accelerator.process_index)
    if accelerator.num_processes == 1:
        return [problem] if problem else []
    from accelerate.utils import gather_object

    return [p for p in gather_object([problem]) if p]


def options_as_used(values: dict[str, Any]) -> dict[str, Any]:
    """Options as a run uses them: an unset --max-grad-norm is the levers' default (0 where an
    update cannot wait for clipping), so leaving it out and giving that value are the same."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        config = TrainConfig(**{k: v for k, v in values.items() if k in names})
    except TypeError:  # a checkpoint of another effitrain version: compared as written
        return values
    return {**values, "max_grad_norm": levers.max_grad_norm(config)}


def summarize(
    run: Run,
    progress: TrainingProgress,
    timer: Stopwatch,
    last_checkpoint: Path | None,
    final_model_dir: Path | None,
) -> TrainResult:
    """What the run cost, measured from the real storage (a collective: all ranks call it)."""
    accelerator = run.accelerator
    peak_bytes, peak_kind = ledger.peak_memory_bytes(accelerator.device)
    ranks = distributed.gather_rank_memory(accelerator, run.model, run.optimizer, run.weights)
    final_eval: dict[str, Any] = progress.eval_history[-1]
    train_seconds = timer.train_seconds
    # FLOPs of the real first step (train_steps), not of a second build on fake tensors: the
    # step counted is the step timed, and the median leaves out the first step and its counting.
    speed = throughput(
        progress.step_cost, timer.median_step_seconds, device_name(accelerator.device)
    )
    return TrainResult(
        optimizer=run.optimizer_spec.name,
        optimizer_class=run.optimizer_spec.class_path,
        lr=run.hyperparameters.lr,
        global_steps=progress.global_step,
        epochs=len(progress.eval_history),
        train_loss=progress.train_loss,
        eval={k: v for k, v in final_eval.items() if k not in ("epoch", "step", "sample")},
        task=run.task.name,
        speed_unit=run.task.speed_unit,
        eval_history=progress.eval_history,
        loss_history=progress.loss_history,
        train_metrics={
            k: v
            for k, v in (progress.loss_history[-1] if progress.loss_history else {}).items()
            if k not in ("step", "loss")
        },
        histories=run.loss.histories(),
        memory=memory_record(run, progress),
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        seconds_per_step=timer.median_step_seconds,
        samples_per_second=progress.total_samples / train_seconds if train_seconds > 0 else 0.0,
        tokens_per_second=progress.total_tokens / train_seconds if train_seconds > 0 else 0.0,
        train_seconds=train_seconds,
        num_processes=accelerator.num_processes,
        mixed_precision=accelerator.mixed_precision,
        device=str(accelerator.device),
        config=run.config.to_dict(),
        last_checkpoint=str(last_checkpoint) if last_checkpoint else None,
        final_model_dir=str(final_model_dir) if final_model_dir else None,
        sharding=run.launch.sharding.to_dict(),
        ranks=ranks,
        ranks_total=distributed.rank_totals(ranks),
        **speed,
    )
