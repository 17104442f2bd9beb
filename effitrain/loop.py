"""The training loop, top to bottom: :func:`train_step` is the loop body, :func:`fit`
runs it over epochs, :func:`evaluate` measures after each epoch.

One optimizer step, as in Accelerate's own examples::

    with accelerator.accumulate(model):
        loss = model(**batch).loss  # or a sum over tokens, weighed by the step's tokens
        accelerator.backward(loss)
        clip, guard
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

Around it, the loop only asks components: the :class:`TrainingProgress` counts and sums, the
:class:`StepGuard` decides whether the update may happen (finite loss and gradients) and whether
a signal asked to stop, the :class:`Checkpointer` decides when to save, the reporter prints.
Every process computes; only the main process prints (through the reporter).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import effitrain.checkpoint as checkpoint
import effitrain.levers as levers
from effitrain.cost import StepCounter
from effitrain.errors import EffitrainError
from effitrain.memory.ledger import unwrap_prepared
from effitrain.memory.step import StepMemoryProbe, compiles_step
from effitrain.optim import set_train_mode
from effitrain.progress import Stopwatch, TrainingProgress
from effitrain.results import StepLog, step_peak
from effitrain.signals import StopRequest, TrainingStopped

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from effitrain.report.live import Reporter
    from effitrain.run import Run


class StepOutcome(NamedTuple):
    stepped: bool
    """The optimizer stepped (the last micro-batch of an accumulation group)."""
    stop: bool
    """Every process agreed to stop after this step (a signal arrived)."""


class Weights(NamedTuple):
    """How a token-weighted micro-batch's loss sum enters its optimizer step
    (:func:`effitrain.tasks.lm_loss.step_scale`)."""

    backward: Any
    """Factor for the loss that backward sees: (processes x accumulation steps) / tokens."""
    logged: Any
    """Factor for the loss that is logged: (processes x this step's micro-batches) / tokens, so
    that the logged mean over micro-batches is the step's token mean."""


def train_step(
    run: Run,
    batch: dict[str, Any],
    progress: TrainingProgress,
    guard: StepGuard,
    weights: Weights | None = None,
) -> StepOutcome:
    """One micro-batch forward and backward; on the last of each group, one optimizer step.

    Inside ``accumulate()``, backward syncs gradients only on the last micro-batch of each
    group, and ``optimizer.step()``/``zero_grad()`` are no-ops on the others.

    Raises:
        EffitrainError: the loss or the gradient norm is not finite (nothing was updated,
            except with --optimizer-in-backward, whose updates run inside backward).
    """
    accelerator, model = run.accelerator, run.model
    optimizer, lr_scheduler = run.optimizer, run.lr_scheduler
    stop = False
    with accelerator.accumulate(model):
        # The levers' contexts (--activation-offload: what forward saves waits in host memory).
        with lever_contexts(run, batch):
            loss = logged = run.loss(model, batch)  # the task's: model(**batch).loss by default
            if weights is not None:  # a sum over tokens: weighed by the step's tokens
                loss, logged = loss * weights.backward, loss.detach() * weights.logged
            accelerator.backward(loss)
        # Summed on the device: no sync.
        progress.add_micro_batch(logged, batch_examples(batch), batch_tokens(batch))
        if accelerator.sync_gradients:
            progress.measure_gradients(model)  # once, at the first step
            grad_norm = None
            if run.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            # Before the update: one host sync; a non-finite loss or gradient raises here.
            stop = guard.check(loss, grad_norm, progress)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return StepOutcome(accelerator.sync_gradients, stop)


def lever_contexts(run: Run, batch: dict[str, Any]) -> ExitStack:
    """Every lever's context around a micro-batch's forward and backward, entered in order,
    then those made for ``batch`` (context parallelism's share of the sequence)."""
    stack = ExitStack()
    for context in [*run.lever_contexts.values(), *levers.batch_contexts(run, batch)]:
        stack.enter_context(context)
    return stack


def batch_examples(batch: dict[str, Any]) -> int:
    """The batch's examples: a preference batch's pairs (``example``: one id per pair, its rows
    are twice as many), else its rows."""
    return len(batch["example"] if "example" in batch else batch["labels"])


def batch_tokens(batch: dict[str, Any]) -> Any:
    """The batch's input tokens, padding left out (a device tensor: no sync)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = batch.get("input_ids")
    return ids.numel() if ids is not None else 0


class StepGuard:
    """Decides, before each update, whether it may happen and whether to stop after it.

    Both answers are agreed by all processes in one tiny all-reduce, so every rank raises, or
    stops, at the same step.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        stop: StopRequest,
        output_dir: str | None,
        updates_in_backward: bool = False,
    ):
        self.accelerator = accelerator
        self.stop = stop
        self.output_dir = output_dir
        self.updates_in_backward = updates_in_backward
        """--optimizer-in-backward: the update has already happened when the check runs."""

    def check(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None, progress: TrainingProgress
    ) -> bool:
        """Whether every process agreed to stop after this step.

        ``progress.window_loss`` sums the losses since the last log line, so a non-finite loss
        in any micro-batch of this step shows up in it.

        Raises:
            EffitrainError: a loss or the gradient norm is not finite, on any process.
        """
        import torch

        # NaN and inf survive a sum, so one scalar carries both checks.
        check = progress.window_loss
        if grad_norm is not None:
            check = check + grad_norm
        if self.accelerator.num_processes == 1:
            # float() syncs the device: once per optimizer step, before the update is queued.
            finite, stop = math.isfinite(float(check)), self.stop.requested
        else:
            flags = torch.stack(
                [check.to(torch.float64), torch.tensor(float(self.stop.requested)).double()]
            )
            check_sum, votes = self.accelerator.reduce(
                flags.to(self.accelerator.device), "sum"
            ).tolist()
            finite, stop = math.isfinite(check_sum), votes > 0
        if not finite:
            raise self._nonfinite_error(loss, grad_norm, progress)
        return stop

    def _nonfinite_error(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None, progress: TrainingProgress
    ) -> EffitrainError:
        loss_value = float(loss.detach())
        what = f"loss {loss_value}"
        if math.isfinite(loss_value):
            if grad_norm is not None and not math.isfinite(float(grad_norm)):
                what = f"gradient norm {float(grad_norm)} (loss {loss_value:.4f})"
            else:
                what = "loss (in an earlier micro-batch of this step, or on another process)"
        latest = checkpoint.find_latest(self.output_dir) if self.output_dir else None
        resume = f"; last good checkpoint: {latest}" if latest else ""
        where = f"non-finite {what} at step {progress.global_step + 1} (epoch {progress.epoch + 1})"
        if self.updates_in_backward:
            return EffitrainError(
                f"{where}: --optimizer-in-backward already applied this step's update in "
                f"backward; stopped, nothing saved{resume}. Try a lower --lr"
            )
        return EffitrainError(
            f"{where}: stopped before the update, nothing saved{resume}. "
            "Try a lower --lr or --max-grad-norm 1.0"
        )


class StepDone(NamedTuple):
    stop: bool
    """Every process agreed to stop after this step (a signal arrived)."""
    measured: bool
    """This step's memory was broken down by kind (it ran slower: leave it out of the times)."""


def train_steps(
    run: Run,
    batches: Iterable[dict[str, Any]],
    progress: TrainingProgress,
    guard: StepGuard,
    probe: StepMemoryProbe,
) -> Iterator[StepDone]:
    """The micro-batches through :func:`train_step`, one optimizer step's worth at a time, with
    the step the plan names measured by ``probe`` (into ``progress.step_memory``) and the first
    one counted (its FLOPs and bytes, into ``progress.step_cost``: ``effitrain.cost``); yields
    after each optimizer step, once ``progress`` counts it. ``effitrain estimate`` runs its fake
    steps through this too."""
    group_start = True  # the next micro-batch starts an optimizer step
    # A step torch.compile'd with fullgraph (torchao's) refuses to run under a dispatch mode.
    countable = not compiles_step(unwrap_prepared(run.optimizer))
    counter: StepCounter | None = None
    micro_batches = 0
    try:
        generating = functools.partial(generation_probe, run, progress, probe)
        for batch, weights in step_batches(run, batches, generating):
            if group_start and measure_now(run, progress, probe):
                probe.start()
            elif probe.running:
                probe.next_micro_batch()
            if group_start and progress.step_cost is None and countable:
                # Entered after the probe and left before it: dispatch modes nest.
                counter, micro_batches = StepCounter().__enter__(), 0
            outcome = train_step(run, batch, progress, guard, weights)
            micro_batches += 1
            group_start = outcome.stepped
            if not outcome.stepped:
                continue
            if counter is not None:
                counted, counter = counter, None
                counted.__exit__(None, None, None)
                progress.step_cost = counted.cost(**levers.step_cost(run, micro_batches))
            measured = probe.running
            if measured:
                step_memory, generated = probe.stop(), probe.generation_memory
                progress.step_memory = step_memory.to_dict() if step_memory else {}
                progress.generation_memory = generated.to_dict() if generated else {}
            progress.step_done()
            yield StepDone(outcome.stop, measured)
    finally:
        if counter is not None:  # an error mid-step leaves no dispatch mode behind
            counter.__exit__(None, None, None)


def fit(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
    stop: StopRequest,
) -> Stopwatch:
    """Train from where ``progress`` is to the end of the plan; evaluate after each epoch.

    Returns the step times (evaluation and saving left out).

    Raises:
        TrainingStopped: a signal asked to stop; the step was finished and saved first.
        EffitrainError: a non-finite loss or gradient (see :class:`StepGuard`).
    """
    plan, config = run.plan, run.config
    guard = StepGuard(run.accelerator, stop, config.output_dir, levers.updates_in_backward(config))
    timer = Stopwatch()
    reporter.progress_started(plan.total_steps, completed=progress.global_step)
    run.model.train()
    set_train_mode(run.optimizer, True)  # schedule-free: steps only in train mode
    # One optimizer step is measured by kind (effitrain.memory.step), late (see measure_now).
    probe = StepMemoryProbe(
        run.model, run.optimizer, run.accelerator.device, extra=run.loss.step_tensors()
    )
    budget_checked = config.max_memory is None
    with probe:  # an error mid-step leaves no tracker behind
        while progress.global_step < plan.total_steps:
            for done in train_steps(run, epoch_batches(run, progress), progress, guard, probe):
                timer.lap()
                if done.measured:
                    timer.leave_out_last()
                reporter.step_done(progress.global_step)
                if not budget_checked and progress.global_step > budget_step(run):
                    check_measured_budget(run, progress, checkpointer, reporter)
                    budget_checked = True
                if progress.global_step % config.log_every == 0 or _finished(run, progress):
                    reporter.logged(log_line(run, progress, timer))
                if done.stop:
                    _stop(run, progress, checkpointer, reporter, stop)
                with timer.paused():
                    _report_saved(reporter, checkpointer.after_step(progress), progress)
                if _finished(run, progress):
                    break
            with timer.paused():
                end_epoch(run, progress, checkpointer, reporter)
            if progress.step_in_epoch and not _finished(run, progress):  # never loop on one epoch
                raise EffitrainError(
                    f"epoch {progress.epoch + 1} yielded {progress.step_in_epoch} of "
                    f"{run.plan.steps_per_epoch} steps: did the training data change size?"
                )
    reporter.progress_finished()
    return timer


def measure_now(run: Run, progress: TrainingProgress, probe: StepMemoryProbe) -> bool:
    """Whether the optimizer step about to start is the one to measure by kind: one of the run's
    last two (``Plan.measured_step``).

    The optimizer state exists in it, as in every step after the first. Not an early one: the
    tracker's bookkeeping (a Python object per storage and per module event) leaves the C heap
    laid out so that every later step grows it, which would raise the run's peak RSS
    (docs/memory.md). Late, the bookkeeping lands where RSS already peaks, so the probe trims
    the heap first (:func:`effitrain.memory.step.return_freed_heap`). A run stopped before that
    step (a signal) has no breakdown; a resumed run that starts after it measures its first
    step. With ``--max-memory`` on the CPU, :func:`budget_step` instead: its peak tensor bytes
    are what the budget is checked against.
    """
    if progress.step_memory or probe.done:
        return False
    if run.config.max_memory is not None and run.accelerator.device.type == "cpu":
        return progress.global_step >= budget_step(run)  # for check_measured_budget
    return run.config.memory_breakdown and progress.global_step >= run.plan.measured_step


def generation_probe(
    run: Run, progress: TrainingProgress, probe: StepMemoryProbe
) -> AbstractContextManager[None]:
    """Where the loss generates (GRPO), the generation of the step about to be measured is
    measured by ``probe`` as that step's generation phase; else nothing is."""
    if run.loss.generates and measure_now(run, progress, probe):
        return probe.generation()
    return nullcontext()


def budget_step(run: Run) -> int:
    """The step (0-based) whose peak ``--max-memory`` is checked against, the first of this run
    at or after it: one that starts with the optimizer's state in place, as every later step
    does (a fresh run's second step; a resumed run's first, its state loaded; a one-step run's
    only step). The first step of a fresh run creates the state, so its backward runs without
    it and under-states the rest. Under ``--num-iterations`` N, step N: the first that
    generates with the state in place, so the budget sees both phases (where the run is long
    enough)."""
    return min(run.plan.generation_period, run.plan.total_steps - 1)


def _finished(run: Run, progress: TrainingProgress) -> bool:
    return progress.global_step >= run.plan.total_steps


def epoch_batches(run: Run, progress: TrainingProgress) -> Iterable[dict[str, Any]]:
    """This epoch's batches; a resumed epoch skips the ones it already trained on.

    Data order depends only on (seed, epoch), so the skipped batches are the same ones. Under
    ``--num-iterations`` N each step's batches serve N steps: a run resumed between them reads
    its step's batches again, and the loss goes on with what it generated from them.
    """
    # Accelerate's prepared loader (untyped: mypy sees the DataLoader) seeds its order here.
    run.train_loader.set_epoch(progress.epoch)  # type: ignore[attr-defined]
    skip = progress.step_in_epoch // run.config.num_iterations * run.config.grad_accum
    if skip:
        return run.accelerator.skip_first_batches(run.train_loader, skip)
    return run.train_loader


def step_batches(
    run: Run,
    batches: Iterable[dict[str, Any]],
    generating: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> Iterator[tuple[dict[str, Any], Weights | None]]:
    """The micro-batches, one optimizer step's worth at a time, each with its token weights
    (None where the loss is the model's per-micro-batch mean); ``generating``: the context
    the loss's own work on a step's batches runs in (:func:`generation_probe`).

    A step's batches are read before its first forward, so that its labelled tokens are known
    on every process (one all-reduce). Accelerate's accumulation counter is set so that the
    step's last micro-batch syncs and steps, also for an epoch's shorter last step. The loss
    makes the read batches into one or more steps' (GRPO: ``--num-iterations`` of them).
    """
    from effitrain.tasks.lm_loss import step_scale

    accelerator, per_step = run.accelerator, run.config.grad_accum
    iterator = iter(batches)
    while read := list(itertools.islice(iterator, per_step)):
        # GRPO generates and scores here, inside ``generating``
        for group in run.loss.step_batches(run, read, generating):
            accelerator.step = per_step - len(group)
            weights = None
            if run.loss.token_weighted:
                backward = step_scale(group, accelerator)
                weights = Weights(backward, backward * len(group) / per_step)
            for batch in group:
                yield batch, weights


def log_line(run: Run, progress: TrainingProgress, timer: Stopwatch) -> StepLog:
    """The loss, lr and speed since the last log line, summed over processes (one sync), and the
    loss's own window metrics (a preference loss's rewards); also sent to the ``--report-to``
    trackers."""
    loss_sum, batches, samples = progress.flush_window()
    elapsed = timer.window_seconds()
    remaining = run.plan.total_steps - progress.global_step
    log = StepLog(
        step=progress.global_step,
        total_steps=run.plan.total_steps,
        epoch=progress.epoch + 1,
        loss=loss_sum / max(batches, 1),
        lr=float(run.lr_scheduler.get_last_lr()[0]),
        samples_per_second=samples / elapsed if elapsed > 0 else 0.0,
        eta_seconds=remaining * timer.recent_mean(run.config.log_every),
        tokens_per_second=progress.window_tokens / elapsed if elapsed > 0 else 0.0,
        metrics=run.loss.window_metrics(run.accelerator),
    )
    progress.loss_history.append({"step": log.step, "loss": log.loss, **log.metrics})
    run.trackers.log_train(log)
    return log


def end_epoch(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
) -> None:
    """Evaluate where the epoch (or the run) ended, record it, save if the policy says so."""
    metrics = evaluate(run)
    epoch_complete = progress.step_in_epoch >= run.plan.steps_per_epoch
    reporter.evaluated(progress.epoch_number, metrics, final=not epoch_complete)
    run.trackers.log_evaluation(metrics, progress.global_step)
    progress.record_evaluation(metrics, epoch_complete)
    _report_saved(reporter, checkpointer.after_evaluation(progress), progress)


def _stop(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
    stop: StopRequest,
) -> None:
    """SIGINT/SIGTERM: this step is complete; keep it, say how to continue, leave."""
    reporter.progress_finished()
    path = checkpointer.on_stop(progress)
    command = checkpoint.resume_command(run.config, run.accelerator.num_processes)
    reporter.stopped(stop.signal_name, progress.global_step, path, command if path else None)
    raise TrainingStopped(stop.exit_code, path)


def measured_peak(run: Run, progress: TrainingProgress) -> int | None:
    """The peak ``--max-memory`` is checked against: CUDA's reserved bytes, else the measured
    step's peak tensor bytes, its generation phase's where that is higher (None: not
    measured)."""
    import torch

    device = run.accelerator.device
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    peak = (progress.step_memory or {}).get("peak_tensor_bytes")
    generation = (progress.generation_memory or {}).get("peak_tensor_bytes")
    return step_peak(peak, generation) if peak is not None else None


def check_measured_budget(
    run: Run,
    progress: TrainingProgress,
    checkpointer: checkpoint.Checkpointer,
    reporter: Reporter,
) -> None:
    """``--max-memory``, after :func:`budget_step`: a measured peak above it (on any process)
    keeps this step as a signal would and stops the run.

    Raises:
        EffitrainError: over the budget; the message names the checkpoint and the overshoot.
    """
    import torch

    from effitrain.config import parse_size
    from effitrain.memory.ledger import format_bytes

    budget = parse_size(run.config.max_memory or "", "--max-memory")
    peak = measured_peak(run, progress)
    local = torch.tensor([peak or 0], dtype=torch.int64, device=run.accelerator.device)
    peak = int(run.accelerator.gather(local).max())  # every process stops together
    if peak <= budget:
        return
    reporter.progress_finished()
    path = checkpointer.on_stop(progress)
    kept = f"checkpoint: {path}" if path else "nothing saved (add --output-dir DIR to keep it)"
    what = "reserved" if run.accelerator.device.type == "cuda" else "peak tensor memory"
    raise EffitrainError(
        f"--max-memory {run.config.max_memory}: step {progress.global_step} measured "
        f"{format_bytes(peak)} {what}, {format_bytes(peak - budget)} over; stopped, "
        f"{kept}"
    )


def _report_saved(reporter: Reporter, path: Path | None, progress: TrainingProgress) -> None:
    if path is not None:
        reporter.checkpoint_saved(str(path), progress.global_step)


def evaluate(run: Run) -> dict[str, Any]:
    """The task's evaluation over the whole validation set, in eval mode (no dropout; a
    schedule-free optimizer's averaged weights), then back to training."""
    run.model.eval()
    set_train_mode(run.optimizer, False)
    try:
        return run.task.evaluate(run)
    finally:
        run.model.train()
        set_train_mode(run.optimizer, True)
