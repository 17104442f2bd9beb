"""The training loop, top to bottom.

Build in order (data -> model -> optimizer -> scheduler -> prepare), then for each batch:
forward, ``accelerator.backward``, clip, ``optimizer.step``, ``lr_scheduler.step``,
``optimizer.zero_grad``; evaluate after each epoch; measure the optimizer state at the end.
Every process computes; only the main process prints (through the reporter).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain import checkpoint, distributed, memory
from effitrain.config import TrainConfig
from effitrain.data import build_dataloaders, load_data, steps_per_epoch
from effitrain.errors import EffitrainError
from effitrain.models import load_model, load_tokenizer
from effitrain.optim import build_optimizer, build_scheduler, get_spec, resolve_lr
from effitrain.report import Reporter, RunInfo, StepLog

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader


@dataclass
class TrainResult:
    """What a run measured; ``to_dict`` is the ``--metrics-json`` object."""

    optimizer: str
    optimizer_class: str
    lr: float
    global_steps: int
    epochs: int
    train_loss: float
    eval: dict[str, float]
    eval_history: list[dict[str, float]]
    optimizer_state: memory.OptimizerStateLedger
    parameter_bytes: int
    trainable_parameters: int
    gradient_bytes: int
    adamw_equivalent_bytes: int
    adamw_equivalent_elements: int
    peak_memory_bytes: int
    peak_memory_kind: str
    seconds_per_step: float
    samples_per_second: float
    train_seconds: float
    num_processes: int
    mixed_precision: str
    device: str
    config: dict[str, Any] = field(default_factory=dict)
    last_checkpoint: str | None = None
    """The newest checkpoint this run wrote (None when it wrote none)."""
    final_model_dir: str | None = None
    """Where save_pretrained wrote the model and tokenizer (``--output-dir``/final)."""
    sharding: dict[str, Any] = field(default_factory=dict)
    """How Accelerate distributed the run (``distributed.Sharding``)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per process: rank, optimizer_state_bytes, parameter_bytes, peak memory, checksum."""
    ranks_total: dict[str, int] = field(default_factory=dict)
    """The per-rank byte counts summed over all processes."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer_state"] = self.optimizer_state.to_dict()
        return data


def evaluate(model: Any, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Loss, accuracy and F1 over the whole validation set, each example counted once.

    ``gather_for_metrics`` drops the samples that the last batch repeats to even out processes.
    F1 is binary for two labels and macro-averaged otherwise (scikit-learn).
    """
    import torch
    import torch.nn.functional as F
    from sklearn.metrics import accuracy_score, f1_score

    model.eval()
    predictions, references, losses = [], [], []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        per_example_loss = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        preds, refs, loss = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"], per_example_loss)
        )
        predictions.append(preds.cpu())
        references.append(refs.cpu())
        losses.append(loss.cpu())
    model.train()
    y_pred = torch.cat(predictions).numpy()
    y_true = torch.cat(references).numpy()
    num_labels = accelerator.unwrap_model(model).config.num_labels
    average = "binary" if num_labels == 2 else "macro"
    return {
        "loss": float(torch.cat(losses).mean()),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "f1": float(f1_score(y_true, y_pred, average=average, zero_division=0)),
        "examples": int(len(y_true)),
    }


def _check_outputs_writable(config: TrainConfig) -> None:
    """Fail before training, not after it, when results could not be written."""
    if config.metrics_json:
        parent = Path(config.metrics_json).expanduser().resolve().parent
        existing = next(p for p in (parent, *parent.parents) if p.exists())
        if not existing.is_dir():
            raise EffitrainError(
                f"--metrics-json {config.metrics_json}: {existing} is not a folder"
            )


def _check_fresh_output_dir(config: TrainConfig) -> None:
    """A new run must not mix its checkpoints with an earlier run's."""
    if config.output_dir and not config.resume:
        latest = checkpoint.find_latest(config.output_dir)
        if latest is not None:
            raise EffitrainError(
                f"{config.output_dir} already holds checkpoints (newest: {latest.name}); "
                "continue that run with --resume latest, or choose another --output-dir"
            )


class TrainingStopped(Exception):
    """SIGINT/SIGTERM stopped the run after a complete step (and a checkpoint, with --output-dir)."""

    def __init__(self, exit_code: int, checkpoint_path: Path | None):
        super().__init__(f"stopped (exit code {exit_code})")
        self.exit_code = exit_code
        self.checkpoint_path = checkpoint_path


def _parameter_shapes(model: Any) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _optimizer_param_names(model: Any, optimizer: Any) -> list[str]:
    """Parameter names in the optimizer's state-dict order (ids 0, 1, …)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"]]


def _resume(
    config: TrainConfig,
    accelerator: Accelerator,
    model: Any,
    optimizer: Any,
    reporter: Reporter,
) -> checkpoint.LoopState:
    """Check the ``--resume`` checkpoint against this run, then load it (weights, optimizer,
    scheduler, RNG states) and return the loop counters to continue from."""
    spec = get_spec(config.optim)
    path = checkpoint.resolve_resume(config.resume, config.output_dir)
    meta = checkpoint.read_metadata(path)
    checkpoint.check_resumable(
        meta,
        path,
        optimizer_name=spec.name,
        optimizer_class=spec.class_path,
        param_groups=optimizer.param_groups,
        parameter_shapes=_parameter_shapes(accelerator.unwrap_model(model)),
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
    checkpoint.load_checkpoint(accelerator, path)
    state = checkpoint.LoopState.from_dict(meta)
    reporter.resumed(str(path), state.global_step, state.epoch, state.step_in_epoch)
    return state


def _step_flags(
    accelerator: Accelerator, loss_sum: Any, grad_norm: Any, stop: checkpoint.StopRequest
) -> tuple[bool, bool]:
    """(a loss or the gradient norm is not finite, a stop was requested), agreed by all processes.

    ``loss_sum`` is the device-side sum of the losses since the last log line, so a non-finite
    loss in any micro-batch of this step shows up in it. Deciding before ``optimizer.step`` costs
    one add and one host sync per optimizer step (``float()`` of a device scalar), about 20 us
    on CPU. On a GPU the sync waits for backward and clipping to finish before the optimizer
    kernels are queued, which the next batch's host-to-device copy would do a moment later
    anyway. With several processes the check and the stop flag travel in one tiny all-reduce,
    so every rank stops at the same step.
    """
    import torch

    # NaN and inf survive a sum, so one scalar carries both checks (one op, one sync).
    check = loss_sum if grad_norm is None else loss_sum + grad_norm
    if accelerator.num_processes == 1:
        return not math.isfinite(float(check)), stop.requested
    flags = torch.stack(
        [check.to(torch.float64), torch.tensor(float(stop.requested), dtype=torch.float64)]
    )
    check_sum, stop_votes = accelerator.reduce(flags.to(accelerator.device), "sum").tolist()
    return not math.isfinite(check_sum), stop_votes > 0


def _nonfinite_error(
    loss: Any, grad_norm: Any, step: int, epoch: int, output_dir: str | None
) -> EffitrainError:
    """The message for a non-finite loss or gradient (the update was not applied)."""
    loss_value = float(loss.detach())
    what = f"loss {loss_value}"
    if math.isfinite(loss_value):
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            what = f"gradient norm {float(grad_norm)} (loss {loss_value:.4f})"
        else:
            what = "loss (in an earlier micro-batch of this step, or on another process)"
    latest = checkpoint.find_latest(output_dir) if output_dir else None
    resume = f"; last good checkpoint: {latest}" if latest else ""
    return EffitrainError(
        f"non-finite {what} at step {step} (epoch {epoch + 1}): stopped before the update, "
        f"nothing saved{resume}. Try a lower --lr or --max-grad-norm 1.0"
    )


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run one training job as configured and return what it measured.

    Raises:
        EffitrainError: a user-fixable problem (bad data, model, optimizer, options).
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    _check_outputs_writable(config)
    _check_fresh_output_dir(config)
    try:
        accelerator = Accelerator(
            # Several launched processes and no GPU: CPU processes over gloo (see distributed.py).
            cpu=distributed.cpu_for_launch(),
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.grad_accum,
            # A seedable sampler makes data order depend only on (seed, epoch), on every rank.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        )
    except (ValueError, RuntimeError) as exc:
        raise EffitrainError(
            f"--mixed-precision {config.mixed_precision} is not available here: {exc}"
        ) from exc
    if reporter is None:
        reporter = Reporter(enabled=accelerator.is_main_process, quiet=config.quiet)
    set_seed(config.seed)
    if accelerator.num_processes == 1 and torch.cuda.device_count() > 1:
        reporter.note(
            f"{torch.cuda.device_count()} GPUs are visible but this run uses one; to use them all: "
            "accelerate launch --multi_gpu -m effitrain train ..."
        )

    # 1. Data and model. The main process goes first so it alone fills the datasets cache.
    with accelerator.main_process_first():
        data = load_data(config)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, data.num_labels, data.label_names, tokenizer)
    with accelerator.main_process_first():
        train_loader, eval_loader = build_dataloaders(
            data,
            tokenizer,
            config,
            pad_to_multiple_of=8 if config.mixed_precision != "no" else None,
        )
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)

    # 2. How long: optimizer steps per epoch on this process, and in total.
    per_epoch = steps_per_epoch(len(train_loader), config.grad_accum)
    if per_epoch == 0:
        raise EffitrainError("the training set yields no batches; check --batch-size and the data")
    total_steps = config.max_steps or per_epoch * config.epochs
    num_epochs = math.ceil(total_steps / per_epoch)
    warmup = (
        config.warmup_steps
        if config.warmup_steps is not None
        else math.ceil(total_steps * config.warmup_ratio)
    )

    # 3. Optimizer and schedule. Accelerate's prepared scheduler steps once per process on every
    # optimizer step, so its lengths are counted in process-steps.
    spec = get_spec(config.optim)
    # What FSDP/DeepSpeed would do to this optimizer: refuse or warn before anything is built.
    sharding = distributed.check_sharding(accelerator, config, reporter)
    lr = resolve_lr(config)
    optimizer = build_optimizer(model, config)
    n = accelerator.num_processes
    lr_scheduler = build_scheduler(optimizer, config, total_steps * n, warmup * n)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)

    reporter.run_started(
        RunInfo(
            model=config.model,
            model_class=type(accelerator.unwrap_model(model)).__name__,
            parameters=memory.trainable_parameter_count(model),
            dataset=data.source,
            train_examples=len(data.train),
            validation_examples=len(data.validation),
            validation_source=data.validation_source,
            text_columns=data.text_columns,
            label_column=data.label_column,
            num_labels=data.num_labels,
            optimizer=spec.name,
            optimizer_class=spec.class_path,
            lr=lr,
            total_steps=total_steps,
            epochs=num_epochs,
            steps_per_epoch=per_epoch,
            global_batch_size=config.batch_size * config.grad_accum * n,
            device=str(accelerator.device),
            num_processes=n,
            mixed_precision=accelerator.mixed_precision,
        )
    )

    # 3b. Resume: the checkpoint is checked against this run before anything is loaded.
    start = _resume(config, accelerator, model, optimizer, reporter) if config.resume else None
    start = start or checkpoint.LoopState()
    unwrapped = accelerator.unwrap_model(model)
    param_names = _optimizer_param_names(unwrapped, optimizer)
    parameter_shapes = _parameter_shapes(unwrapped)

    # 4. The loop. Counters, sums and history continue from the checkpoint when resuming.
    device = accelerator.device
    global_step = start.global_step
    gradient_bytes = start.gradient_bytes
    # Running sums since the last log line: loss, micro-batches, samples. They stay on the device:
    # reading them (.tolist()) syncs, so it happens once per log interval, not per step. A resumed
    # run's unlogged sums (summed over processes when saved) come back on the main process only.
    window = torch.tensor(
        start.window if accelerator.is_main_process else [0.0, 0.0, 0.0],
        device=device,
        dtype=torch.float64,
    )
    total_loss, total_batches, total_samples = (
        start.total_loss,
        start.total_batches,
        start.total_samples,
    )
    step_seconds: list[float] = []
    eval_history: list[dict[str, float]] = list(start.eval_history)
    final_eval: dict[str, float] | None = eval_history[-1] if eval_history else None
    last_checkpoint: Path | None = None
    saved_step = start.global_step if config.resume else -1
    if global_step >= total_steps:
        reporter.note(f"the checkpoint is already at step {global_step} of {total_steps}")

    def save(epoch: int, step_in_epoch: int) -> Path:
        """Write checkpoint-<global_step> (all processes), pointing at (epoch, step_in_epoch)."""
        nonlocal saved_step, last_checkpoint
        loop_state = checkpoint.LoopState(
            global_step=global_step,
            epoch=epoch,
            step_in_epoch=step_in_epoch,
            total_loss=total_loss,
            total_batches=total_batches,
            total_samples=total_samples,
            window=accelerator.reduce(window.clone(), "sum").tolist(),
            eval_history=eval_history,
            gradient_bytes=gradient_bytes,
        )
        metadata = checkpoint.build_metadata(
            config=config,
            loop_state=loop_state,
            optimizer_name=spec.name,
            optimizer_class=spec.class_path,
            param_groups=optimizer.param_groups,
            param_names=param_names,
            parameter_shapes=parameter_shapes,
            world_size=n,
            mixed_precision=accelerator.mixed_precision,
        )
        path = checkpoint.save_checkpoint(
            accelerator, config.output_dir, metadata, config.save_total_limit
        )
        saved_step, last_checkpoint = global_step, path
        reporter.checkpoint_saved(str(path), global_step)
        return path

    reporter.progress_started(total_steps, completed=global_step)
    window_start = last_step_end = time.perf_counter()
    stopping = False
    model.train()
    with checkpoint.stop_on_signals() as stop_request:
        first_epoch = start.epoch if global_step < total_steps else num_epochs
        for epoch in range(first_epoch, num_epochs):
            # Data order depends only on (seed, epoch); a resumed epoch skips what it already saw.
            train_loader.set_epoch(epoch)
            step_in_epoch = start.step_in_epoch if epoch == start.epoch else 0
            batches = train_loader
            if step_in_epoch:
                batches = accelerator.skip_first_batches(
                    train_loader, step_in_epoch * config.grad_accum
                )
            for batch in batches:
                # Inside accumulate(), backward only syncs gradients (and the optimizer only
                # steps) on the last micro-batch of each group; elsewhere step/zero_grad are no-ops.
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    accelerator.backward(loss)
                    window += torch.stack(
                        [
                            loss.detach().to(torch.float64),
                            torch.ones((), device=device, dtype=torch.float64),
                            torch.tensor(
                                batch["labels"].shape[0], device=device, dtype=torch.float64
                            ),
                        ]
                    )
                    if accelerator.sync_gradients:
                        if gradient_bytes == 0:
                            gradient_bytes = memory.gradient_bytes(model)
                        grad_norm = None
                        if config.max_grad_norm > 0:
                            grad_norm = accelerator.clip_grad_norm_(
                                model.parameters(), config.max_grad_norm
                            )
                        # Decided before the update: a non-finite loss or gradient never reaches
                        # the weights. One host sync per optimizer step (see _step_flags).
                        nonfinite, stopping = _step_flags(
                            accelerator, window[0], grad_norm, stop_request
                        )
                        if nonfinite:
                            raise _nonfinite_error(
                                loss, grad_norm, global_step + 1, epoch, config.output_dir
                            )
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue

                global_step += 1
                step_in_epoch += 1
                now = time.perf_counter()
                step_seconds.append(now - last_step_end)
                last_step_end = now
                reporter.step_done(global_step)
                if global_step % config.log_every == 0 or global_step == total_steps:
                    # Summed over processes: the loss shown is the mean over every rank's batches.
                    loss_sum, batches_done, samples = accelerator.reduce(window, "sum").tolist()
                    window.zero_()
                    total_loss += loss_sum
                    total_batches += batches_done
                    total_samples += samples
                    elapsed = now - window_start
                    window_start = now
                    recent = step_seconds[-config.log_every :]
                    reporter.logged(
                        StepLog(
                            step=global_step,
                            total_steps=total_steps,
                            epoch=epoch + 1,
                            loss=loss_sum / max(batches_done, 1),
                            lr=lr_scheduler.get_last_lr()[0],
                            samples_per_second=samples / elapsed if elapsed > 0 else 0.0,
                            eta_seconds=(total_steps - global_step) * statistics.fmean(recent),
                        )
                    )
                if stopping:
                    # SIGINT/SIGTERM: this step is complete; keep it, then leave.
                    reporter.progress_finished()
                    path = save(epoch, step_in_epoch) if config.output_dir else None
                    command = checkpoint.resume_command(config, n) if path else None
                    reporter.stopped(stop_request.signal_name, global_step, path, command)
                    raise TrainingStopped(stop_request.exit_code, path)
                # A checkpoint due at an epoch's last step (or the run's) is written after the
                # evaluation below, so that resuming does not evaluate that epoch again.
                at_boundary = step_in_epoch >= per_epoch or global_step >= total_steps
                if (
                    config.saves_checkpoints
                    and config.save_every
                    and global_step % config.save_every == 0
                    and not at_boundary
                ):
                    pause_start = time.perf_counter()
                    save(epoch, step_in_epoch)
                    pause = time.perf_counter() - pause_start
                    window_start += pause
                    last_step_end += pause
                if global_step >= total_steps:
                    break

            # Evaluate after each epoch (or where max_steps stops); the time is not training time.
            eval_start = time.perf_counter()
            metrics = evaluate(model, eval_loader, accelerator)
            metrics["epoch"] = epoch + 1
            metrics["step"] = global_step
            eval_history.append(metrics)
            final_eval = metrics
            stopped_mid_epoch = global_step >= total_steps and step_in_epoch < per_epoch
            reporter.evaluated(epoch + 1, metrics, final=stopped_mid_epoch)
            epoch_done = step_in_epoch >= per_epoch
            due = (
                config.save_strategy == "epoch"
                or global_step >= total_steps
                or bool(config.save_every and global_step % config.save_every == 0)
            )
            if config.saves_checkpoints and due and saved_step != global_step:
                if epoch_done:
                    save(epoch + 1, 0)
                else:
                    save(epoch, step_in_epoch)
            pause = time.perf_counter() - eval_start
            window_start += pause
            last_step_end += pause
            if global_step >= total_steps:
                break
    reporter.progress_finished()
    if final_eval is None:  # resumed from a checkpoint that was already at the end
        final_eval = evaluate(model, eval_loader, accelerator)
        eval_history.append({**final_eval, "epoch": start.epoch, "step": global_step})
    final_model_dir = None
    if config.output_dir:
        final_model_dir = checkpoint.save_final(accelerator, model, tokenizer, config.output_dir)
        reporter.saved_final(str(final_model_dir))

    # 5. What it cost, measured from the real storage.
    train_seconds = sum(step_seconds)
    peak_bytes, peak_kind = memory.peak_memory_bytes(device)
    # Every rank's numbers, on every process (a collective: all ranks must get here).
    ranks = distributed.gather_rank_memory(accelerator, model, optimizer)
    result = TrainResult(
        optimizer=spec.name,
        optimizer_class=spec.class_path,
        lr=lr,
        global_steps=global_step,
        epochs=len(eval_history),
        train_loss=total_loss / max(total_batches, 1),
        eval={k: final_eval[k] for k in ("accuracy", "f1", "loss", "examples")},
        eval_history=eval_history,
        optimizer_state=memory.optimizer_state_ledger(optimizer),
        parameter_bytes=memory.parameter_bytes(model),
        trainable_parameters=memory.trainable_parameter_count(model),
        gradient_bytes=gradient_bytes,
        adamw_equivalent_bytes=memory.adamw_equivalent_bytes(model),
        adamw_equivalent_elements=memory.adamw_equivalent_elements(model),
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        # The first step pays one-off costs (allocations, lazy state init): leave it out.
        seconds_per_step=statistics.median(step_seconds[1:] or step_seconds or [0.0]),
        samples_per_second=total_samples / train_seconds if train_seconds > 0 else 0.0,
        train_seconds=train_seconds,
        num_processes=n,
        mixed_precision=accelerator.mixed_precision,
        device=str(device),
        config=config.to_dict(),
        last_checkpoint=str(last_checkpoint) if last_checkpoint else None,
        final_model_dir=str(final_model_dir) if final_model_dir else None,
        sharding=sharding.to_dict(),
        ranks=ranks,
        ranks_total=distributed.rank_totals(ranks),
    )
    return result
