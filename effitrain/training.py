"""One training run, in four stages: build, resume or start fresh, fit, summarize.

::

    run = build_run(config, reporter)          # accelerator, data, model, optimizer, scheduler
    progress = TrainingProgress(...)           # counters; loaded from a checkpoint on --resume
    fit(run, progress, checkpointer, ...)      # the loop (effitrain.loop)
    result = summarize(run, progress, ...)     # what it cost, measured from real storage

With ``--report-to``, Accelerate's trackers follow along (:mod:`effitrain.tracking`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import effitrain.checkpoint as checkpoint
import effitrain.distributed as distributed
import effitrain.levers as levers
import effitrain.optim as optim
import effitrain.tracking as tracking
from effitrain.build import Run, build_run, check_config, check_outputs
from effitrain.config import TrainConfig
from effitrain.loop import evaluate, fit
from effitrain.memory import ledger
from effitrain.progress import Stopwatch, TrainingProgress
from effitrain.results import TrainResult
from effitrain.signals import stop_on_signals

if TYPE_CHECKING:
    from effitrain.report import Reporter


def train(config: TrainConfig, reporter: Reporter) -> TrainResult:
    """Run one training job as configured and return what it measured.

    Raises:
        EffitrainError: a user-fixable problem (bad data, model, optimizer, options).
        TrainingStopped: SIGINT/SIGTERM stopped it after a complete (and saved) step.
    """
    check_config(config)
    check_outputs(config)
    tracking.check(config)
    run = build_run(config, reporter)
    reporter.run_started(run.info)
    progress = TrainingProgress.for_accelerator(run.accelerator)
    checkpointer = make_checkpointer(run)
    if config.resume:
        resume(run, progress, checkpointer, reporter)
    tracking.start(run, progress, reporter)
    with stop_on_signals() as stop:
        timer = fit(run, progress, checkpointer, reporter, stop)
    if not progress.eval_history or progress.eval_history[-1]["step"] != progress.global_step:
        # Resumed from a checkpoint saved at the last step but before its evaluation.
        metrics = evaluate(run)
        tracking.log_evaluation(run, metrics, progress.global_step)
        progress.record_evaluation(metrics, epoch_complete=False)
    final_model_dir = None
    optim.set_train_mode(run.optimizer, False)  # schedule-free: save the weights it evaluated
    if config.output_dir:
        final_model_dir = checkpoint.save_final(
            run.accelerator, run.model, run.tokenizer, config.output_dir
        )
        reporter.saved_final(str(final_model_dir))
    result = summarize(run, progress, timer, checkpointer.last_path, final_model_dir)
    if config.output_dir and config.lora_rank is not None:
        save_lora_extras(run, reporter)
    tracking.finish(run, result)
    return result


def save_lora_extras(run: Run, reporter: Reporter) -> None:
    """With --lora-merge, ``final-merged/``: after the summary, because merging changes the
    model in place (its parameters no longer are the ones that trained)."""
    import effitrain.lora as lora

    if run.config.lora_merge:
        merged = lora.save_merged(run.accelerator, run.model, run.tokenizer, run.config.output_dir)
        reporter.saved_final(str(merged))
    note = lora.final_note(run.config)
    if note:
        reporter.note(note)


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
        optimizer_name=run.spec.name,
        optimizer_class=run.spec.class_path,
        # The optimizer's parameters in its state-dict order (ids 0, 1, …), for inspect-state.
        param_names=[
            names.get(id(p), "?") for group in run.optimizer.param_groups for p in group["params"]
        ],
        parameter_shapes={name: list(p.shape) for name, p in model.named_parameters()},
    )


def resume(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
) -> None:
    """Check the ``--resume`` checkpoint against this run, then load it (weights, optimizer,
    scheduler, RNG states, the loop's progress)."""
    config, accelerator = run.config, run.accelerator
    path = checkpoint.resolve_resume(config.resume, config.output_dir)
    meta = checkpoint.read_metadata(path)
    checkpoint.check_resumable(
        meta,
        path,
        optimizer_name=checkpointer.optimizer_name,
        optimizer_class=checkpointer.optimizer_class,
        param_groups=run.optimizer.param_groups,
        parameter_shapes=checkpointer.parameter_shapes,
        fp32_embedding_state=config.fp32_embedding_state,
    )
    differences = checkpoint.config_differences(meta, config)
    if differences:
        reporter.note(
            f"options differ from the checkpoint's run ({'; '.join(differences)}): "
            "the resumed run is not an exact continuation"
        )
    if meta.get("world_size") != accelerator.num_processes:
        reporter.note(
            f"the checkpoint was written by {meta.get('world_size')} process(es), this run has "
            f"{accelerator.num_processes}: data order and batch size differ from the original run"
        )
    if config.load_in_4bit:
        from effitrain.quantize import check_checkpoint_base

        check_checkpoint_base(accelerator.unwrap_model(run.model), path)
    checkpoint.load_checkpoint(accelerator, path, strict=not config.load_in_4bit)
    progress.load_state_dict(meta)
    checkpointer.last_saved_step = progress.global_step
    reporter.resumed(str(path), progress.global_step, progress.epoch, progress.step_in_epoch)
    if progress.global_step >= run.plan.total_steps:
        reporter.note(
            f"the checkpoint is already at step {progress.global_step} of {run.plan.total_steps}"
        )


def summarize(
    run: Run,
    progress: TrainingProgress,
    timer: Stopwatch,
    last_checkpoint: Path | None,
    final_model_dir: Path | None,
) -> TrainResult:
    """What the run cost, measured from the real storage (a collective: all ranks call it)."""
    model, optimizer, accelerator = run.model, run.optimizer, run.accelerator
    peak_bytes, peak_kind = ledger.peak_memory_bytes(accelerator.device)
    ranks = distributed.gather_rank_memory(accelerator, model, optimizer)
    final_eval: dict[str, Any] = progress.eval_history[-1]
    step = progress.step_memory
    train_seconds = timer.train_seconds
    return TrainResult(
        optimizer=run.spec.name,
        optimizer_class=run.spec.class_path,
        lr=run.hyper.lr,
        global_steps=progress.global_step,
        epochs=len(progress.eval_history),
        train_loss=progress.train_loss,
        eval={k: v for k, v in final_eval.items() if k not in ("epoch", "step", "sample")},
        task=run.task.name,
        eval_history=progress.eval_history,
        loss_history=progress.loss_history,
        optimizer_state=ledger.optimizer_state_ledger(optimizer),
        parameter_bytes=ledger.parameter_bytes(model),
        trainable_parameters=ledger.trainable_parameter_count(model),
        # With the step measured by kind: the gradients' own peak (optimizer in backward frees
        # them one by one); else what existed after the first backward.
        gradient_bytes=step.get("kind_peaks", {}).get("gradients", progress.gradient_bytes),
        adamw_equivalent_bytes=ledger.adamw_equivalent_bytes(model),
        adamw_equivalent_elements=ledger.adamw_equivalent_elements(model),
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
        sharding=run.sharding.to_dict(),
        ranks=ranks,
        ranks_total=distributed.rank_totals(ranks),
        trainable_parameter_bytes=ledger.trainable_parameter_bytes(model),
        activation_bytes=step.get("kind_peaks", {}).get("activations"),
        peak_tensor_bytes=step.get("peak_tensor_bytes"),
        step_memory=step,
        levers=levers.active(run.config) + run.loss.levers,
        loss=run.loss.to_dict(),
        quantized_weights=levers.quantized_weights(run.config, model),
        baseline=ledger.fp32_adamw_baseline(
            levers.original_parameters(accelerator.unwrap_model(model))
        ),
        **levers.offload_results(run),
    )
