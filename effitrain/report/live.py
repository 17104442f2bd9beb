"""The live reporter of a run: banner, progress, log and eval lines, the closing summary.

The CLI makes the one :class:`Reporter` of a run; training sets ``enabled`` to whether this is
the main process, so that everything is printed once under ``accelerate launch``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.cost import format_flops
from effitrain.report.memory_tables import memory_table, optimizer_state_table, ranks_table

if TYPE_CHECKING:
    from rich.console import Console

    from effitrain.results import RunInfo, StepLog, TrainResult


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


class Reporter:
    """Prints a run's progress and results on the main process.

    Args:
        enabled: False on every process but the main one: nothing is printed. ``train()``
            sets it once the Accelerator knows which process this is.
        quiet: only the final results are printed.
        console: a rich Console (default: stdout). When it is not a terminal, the progress bar
            is replaced by plain log lines every ``log_every`` steps, so CI logs stay readable.
    """

    def __init__(self, enabled: bool = True, quiet: bool = False, console: Console | None = None):
        from rich.console import Console

        self.enabled = enabled
        self.quiet = quiet
        self.console = console or Console(highlight=False)
        self._progress: Any = None
        self._task: Any = None
        self._speed_unit = "samples"
        """What throughput counts: the task's (set by run_started)."""
        self._epochs = 1
        """How many epochs the run has (set by run_started): a log line names the epoch only
        when there are several."""

    def _line(self, text: str) -> None:
        # soft_wrap: never insert hard line breaks (log files and narrow terminals stay greppable).
        self.console.print(text, soft_wrap=True)

    @property
    def _chatty(self) -> bool:
        return self.enabled and not self.quiet

    def note(self, message: str) -> None:
        """A warning or hint the user should see even with --quiet."""
        if self.enabled:
            from rich.markup import escape

            # escaped: a hint such as pip install 'effitrain[lora]' is text, not markup
            self._line(f"[yellow]note:[/] {escape(message)}")

    def run_started(self, info: RunInfo) -> None:
        self._speed_unit = info.speed_unit
        self._epochs = info.epochs
        if not self._chatty:
            return
        trainable = info.trainable_parameters
        frozen = f", {_count(trainable)} trainable" if trainable < info.parameters else ""
        self._line(
            f"[bold]effitrain[/] · model [cyan]{info.model}[/] ({info.model_class}, "
            f"{_count(info.parameters)} params{frozen})"
        )
        self._line(
            f"  data      {info.dataset}: {info.train_examples:,} train / "
            f"{info.validation_examples:,} validation ({info.validation_source}); {info.data_line}"
        )
        lr_note = f" ({info.lr_note})" if info.lr_note else ""
        self._line(
            f"  optimizer [cyan]{info.optimizer}[/] ({info.optimizer_class}), "
            f"lr {info.lr:g}{lr_note}"
        )
        if info.optimizer_split:
            self._line(f"  split     {info.optimizer_split}")
        schedule_note = f" ({info.schedule_note})" if info.schedule_note else ""
        self._line(
            f"  schedule  {info.total_steps} steps ({info.epochs} epoch(s) × "
            f"{info.steps_per_epoch} steps), {info.warmup_steps} warmup then {info.scheduler}"
            f"{schedule_note}, global batch {info.global_batch_size}"
        )
        # Said here, once: the closing lines then leave the MFU out.
        peak = f"; no MFU: the peak FLOP/s of {info.peak_unknown} is unknown"
        self._line(
            f"  device    {info.device} × {info.num_processes} process(es), "
            f"mixed precision {info.mixed_precision}{peak if info.peak_unknown else ''}"
        )
        for lever in info.levers:
            self._line(f"  lever     {lever}")

    def progress_started(self, total_steps: int, completed: int = 0) -> None:
        if not self._chatty or not self.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=completed, stats=""
        )
        self._progress.start()

    def step_done(self, step: int) -> None:
        """Advance the bar (cheap; called once per optimizer step)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def logged(self, log: StepLog) -> None:
        if not self._chatty:
            return
        # A log line stays within 100 characters for most runs, so a terminal does not wrap
        # it: "tok/s" (the closing lines spell it out), the epoch only where there are several.
        tokens = "tokens/s" if self._progress is not None else "tok/s"
        speed = _speed(log, self._speed_unit, tokens)
        stats = f"loss {log.loss:.4f}{_rewards_text(log.metrics)} · lr {log.lr:.2e} · {speed}"
        if self._progress is not None:
            self._progress.update(self._task, completed=log.step, stats=stats)
        else:
            epoch = f" · epoch {log.epoch}" if self._epochs > 1 else ""
            self._line(
                f"step {log.step}/{log.total_steps}{epoch} · {stats} · "
                f"eta {_duration(log.eta_seconds)}"
            )

    def evaluated(self, epoch: int, metrics: dict[str, float], final: bool = False) -> None:
        if not self._chatty:
            return
        where = "end" if final else f"epoch {epoch}"
        self._line(f"eval ({where}) · {_eval_text(metrics, loss_first=True)}")
        if "sample" in metrics:
            from rich.markup import escape

            scored = (
                f"  reward {metrics['sample_reward']:.3f}" if "sample_reward" in metrics else ""
            )
            self._line(f"  sample    {escape(repr(metrics['sample']))}{scored}")

    def progress_finished(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def finished(self, result: TrainResult) -> None:
        """The closing summary and the optimizer-memory tables (printed even with --quiet)."""
        if not self.enabled:
            return
        self.progress_finished()
        c = self.console
        ev = result.eval
        speed = _speed(result, result.speed_unit)
        self._line(
            f"[bold green]done[/] · {result.global_steps} steps in {result.train_seconds:.1f} s · "
            f"train loss {result.train_loss:.4f} · eval {_eval_text(ev)}"
        )
        self._line(
            f"  speed     {result.seconds_per_step * 1000:.1f} ms/step · {speed}{_work_text(result)}"
        )
        c.print(optimizer_state_table(result))
        c.print(memory_table(result.memory, result.optimizer, result))
        if len(result.ranks) > 1 or result.sharding.get("kind", "single") != "single":
            c.print(ranks_table(result))

    def status(self, message: str) -> None:
        """What the run is doing before its first step (not with --quiet)."""
        if self._chatty:
            self._line(message)

    def saved_metrics(self, path: str) -> None:
        if self._chatty:
            self._line(f"metrics written to {path}")

    def resumed(self, path: str, global_step: int, epoch: int, step_in_epoch: int) -> None:
        """Where a resumed run continues (printed even with --quiet)."""
        if self.enabled:
            self._line(
                f"resumed from {path} · step {global_step} · epoch {epoch + 1}, "
                f"{step_in_epoch} step(s) into it"
            )

    def checkpoint_saved(self, path: str, step: int) -> None:
        if self._chatty:
            self._line(f"checkpoint saved: {path} (step {step})")

    def saved_final(self, path: str) -> None:
        if self._chatty:
            self._line(f"model and tokenizer saved to {path} (save_pretrained, safetensors)")

    def not_saved(self) -> None:
        if self._chatty:
            self._line(
                "the trained model is not saved (no --output-dir); add --output-dir DIR to keep it"
            )

    def stopped_at_once(self, signal_name: str, when: str) -> None:
        """A signal stopped the run outside the loop, ``when`` (even with --quiet)."""
        if self.enabled:
            self.progress_finished()
            self._line(f"[yellow]stopped[/] by {signal_name} {when}")

    def stopped(
        self, signal_name: str, step: int, checkpoint: Path | None, resume_command: str | None
    ) -> None:
        """A signal stopped the run: what was kept and how to continue (even with --quiet)."""
        if not self.enabled:
            return
        self.progress_finished()
        if checkpoint is None:
            self._line(
                f"[yellow]stopped[/] by {signal_name} after step {step}; nothing was saved "
                "(add --output-dir DIR to keep a checkpoint)"
            )
            return
        self._line(
            f"[yellow]stopped[/] by {signal_name} after step {step}; checkpoint: {checkpoint}"
        )
        self._line(f"resume with: {resume_command}")


def _speed(record: StepLog | TrainResult, unit: str, tokens: str = "tokens/s") -> str:
    """Throughput: ``tokens`` (tokens/s, causal-lm, padding left out) or samples/s."""
    if unit == "tokens":
        return f"{record.tokens_per_second:,.0f} {tokens}"
    return f"{record.samples_per_second:,.0f} samples/s"


def _work_text(result: TrainResult) -> str:
    """The step's FLOPs, what the device achieved and, where its peak is known, the MFU (the
    banner says once where it is not)."""
    if result.flops_per_step is None:
        return " · FLOPs not counted"  # torchao's compiled step: docs/cost.md
    if result.achieved_tflops is None:
        return ""
    mfu = f" · MFU {result.mfu:.1%}" if result.mfu is not None else ""
    return (
        f" · {format_flops(result.flops_per_step)}/step · "
        f"{format_flops(result.achieved_tflops * 1e12)}/s per device{mfu}"
    )


def _rewards_text(metrics: dict[str, Any]) -> str:
    """A preference loss's reward accuracy and margin (`` · reward acc 0.625 · margin
    +0.041``), GRPO's rewards, lengths and clipped share by TRL's names, or '' for other
    losses."""
    if "reward" in metrics or "clip_ratio/region_mean" in metrics:  # GRPO (no generation: clip)
        return "".join(f" · {name} {value:.4g}" for name, value in metrics.items())
    if "rewards/accuracies" not in metrics:
        return ""
    return (
        f" · reward acc {metrics['rewards/accuracies']:.3f} · "
        f"margin {metrics['rewards/margins']:+.3f}"
    )


def _eval_text(metrics: dict[str, Any], loss_first: bool = False) -> str:
    """An evaluation's numbers: loss and perplexity (causal-lm), loss and reward accuracy
    (preference), GRPO's rewards (no loss), or accuracy, F1 and loss."""
    if "loss" not in metrics:  # GRPO's: its numbers, less the sample, its reward and the count
        left_out = ("sample", "sample_reward", "examples")
        numbers = {k: v for k, v in metrics.items() if k not in left_out}
        return _rewards_text(numbers).removeprefix(" · ")
    loss = f"loss {metrics['loss']:.4f}"
    if "rewards/accuracies" in metrics:
        return f"{loss}{_rewards_text(metrics)}"
    if "perplexity" in metrics:
        return f"{loss} · perplexity {metrics['perplexity']:.2f}"
    scores = f"accuracy {metrics['accuracy']:.4f} · f1 {metrics['f1']:.4f}"
    return f"{loss} · {scores}" if loss_first else f"{scores} · {loss}"
