"""Where the loop is and what it has summed (:class:`TrainingProgress`), and how long its steps
took (:class:`Stopwatch`).

``TrainingProgress.state_dict()`` is saved in every checkpoint's ``effitrain.json`` (its keys at
the top level) and ``load_state_dict`` restores it on resume, so a resumed run continues its
counters, sums and evaluation history exactly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.memory import ledger

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from effitrain.cost import StepCost


@dataclass(init=False)
class TrainingProgress:
    """The loop's counters and running sums.

    ``epoch`` is the 0-based epoch the loop is in and ``step_in_epoch`` the optimizer steps done
    in it; after an epoch's evaluation they point at the next epoch (``step_in_epoch == 0``).
    Losses, micro-batches and samples since the last log line are summed in a device tensor
    (reading it syncs the device, so that happens once per log interval, not per step).

    Args:
        device: where the running sums live (the accelerator's device).
        reduce: sums a tensor over processes (``accelerator.reduce(t, "sum")``); identity if None.
        is_main_process: only the main process gets a checkpoint's unlogged sums back (they were
            summed over processes when saved).
    """

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    total_loss: float = 0.0
    total_batches: float = 0.0
    total_samples: float = 0.0
    total_tokens: float = 0.0
    """Input tokens trained on (padding left out)."""
    eval_history: list[dict[str, float]] = field(default_factory=list)
    gradient_bytes: int = 0
    """Bytes of the gradients, measured once, at the first optimizer step."""
    step_memory: dict[str, Any] = field(default_factory=dict)
    """The measured optimizer step's tensor memory by kind (``StepMemory.to_dict()``; empty
    when not measured)."""
    generation_memory: dict[str, Any] = field(default_factory=dict)
    """The measured step's generation phase, alike (GRPO; empty where the loss generates
    nothing)."""
    loss_history: list[dict[str, float]] = field(default_factory=list)
    """Every log line's ``{"step", "loss"}`` (the mean loss since the previous one)."""

    def __init__(
        self,
        device: Any = "cpu",
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        is_main_process: bool = True,
    ) -> None:
        import torch

        for f in fields(self):
            setattr(self, f.name, _default(f))
        self._reduce = reduce or (lambda tensor: tensor)
        self._is_main_process = is_main_process
        # Since the last log line: [sum of losses, micro-batches, samples, tokens].
        self._window = torch.zeros(_WINDOW, device=device, dtype=torch.float64)
        self.window_tokens = 0.0
        """Tokens in the window that the last :meth:`flush_window` emptied (all processes)."""
        self.step_cost: StepCost | None = None
        """The first optimizer step's work, counted (``effitrain.cost``); not saved: a resumed
        run counts its first step again."""

    @classmethod
    def for_accelerator(cls, accelerator: Accelerator) -> TrainingProgress:
        return cls(
            device=accelerator.device,
            reduce=lambda tensor: accelerator.reduce(tensor, "sum"),
            is_main_process=accelerator.is_main_process,
        )

    # --- during a step -----------------------------------------------------------------------

    def add_micro_batch(
        self, loss: torch.Tensor, samples: int, tokens: torch.Tensor | int = 0
    ) -> None:
        """Add one micro-batch's loss and size (``tokens``: its non-padding tokens, a device
        tensor or a number) to the window (on the device: no sync)."""
        import torch

        device = self._window.device
        self._window += torch.stack(
            [
                loss.detach().to(torch.float64),
                torch.ones((), device=device, dtype=torch.float64),
                torch.tensor(samples, device=device, dtype=torch.float64),
                torch.as_tensor(tokens, device=device).to(torch.float64),
            ]
        )

    @property
    def window_loss(self) -> torch.Tensor:
        """The device-side sum of losses since the last log line (non-finite if any one was)."""
        return self._window[0]

    def measure_gradients(self, model: Any) -> None:
        """Record the gradients' bytes at the first optimizer step (later steps cost nothing)."""
        if self.gradient_bytes == 0:
            self.gradient_bytes = ledger.gradient_bytes(model)

    def step_done(self) -> None:
        self.global_step += 1
        self.step_in_epoch += 1

    # --- between steps -----------------------------------------------------------------------

    def flush_window(self) -> tuple[float, float, float]:
        """Sum the window over processes, add it to the totals, empty it.

        Returns (sum of losses, micro-batches, samples) since the last call: all processes.
        A collective under several processes, and one host sync.
        """
        loss_sum, batches, samples, tokens = self._reduce(self._window).tolist()
        self._window.zero_()
        self.total_loss += loss_sum
        self.total_batches += batches
        self.total_samples += samples
        self.total_tokens += tokens
        self.window_tokens = tokens
        return loss_sum, batches, samples

    @property
    def epoch_number(self) -> int:
        """The 1-based number of the epoch trained last (0 before any step)."""
        return self.epoch + 1 if self.step_in_epoch else self.epoch

    def record_evaluation(self, metrics: dict[str, float], epoch_complete: bool) -> None:
        """Keep an evaluation in the history; a complete epoch moves to the next one."""
        self.eval_history.append({**metrics, "epoch": self.epoch_number, "step": self.global_step})
        if epoch_complete:
            self.epoch += 1
            self.step_in_epoch = 0

    @property
    def train_loss(self) -> float:
        """The mean loss over every micro-batch logged so far."""
        return self.total_loss / max(self.total_batches, 1)

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue, as JSON-ready values.

        A collective under several processes: the unlogged window is summed over them.
        """
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["eval_history"] = [dict(entry) for entry in self.eval_history]
        state["loss_history"] = [dict(entry) for entry in self.loss_history]
        state["window"] = self._reduce(self._window.clone()).tolist()
        return state

    def load_state_dict(self, state: dict[str, Any], batch_weight: float = 1.0) -> None:
        """Continue from :meth:`state_dict` output (``effitrain.json`` of a checkpoint); the
        :data:`MEASURED` fields stay unmeasured. ``batch_weight``: this run's micro-batches per
        optimizer step over the checkpoint's; the saved loss sums and micro-batch counts are
        scaled by it, so that the train loss weighs every step alike across the resume.

        Raises:
            EffitrainError: a field is missing (a checkpoint of another effitrain version).
        """
        import torch

        restored = [f for f in fields(self) if f.name not in MEASURED]
        missing = [name for name in (*(f.name for f in restored), "window") if name not in state]
        if missing or len(state["window"]) != _WINDOW:
            raise EffitrainError(
                f"the checkpoint's progress lacks {', '.join(missing) or 'a full window'}: it was "
                "written by another effitrain version; start a new --output-dir"
            )
        for f in restored:
            # int(), float(), list() and dict() of the saved JSON values.
            setattr(self, f.name, type(_default(f))(state[f.name]))
        self.total_loss *= batch_weight
        self.total_batches *= batch_weight
        # The window was summed over processes when saved: only the main process takes it back.
        window = [float(x) for x in state["window"]] if self._is_main_process else [0.0] * _WINDOW
        window[0] *= batch_weight
        window[1] *= batch_weight
        self._window = torch.tensor(window, device=self._window.device, dtype=torch.float64)


_WINDOW = 4
MEASURED = frozenset({"gradient_bytes", "step_memory", "generation_memory"})
"""Measurements of the run that saved a checkpoint, not counters: a resumed run (other levers,
other processes) measures its own, so they are not restored."""


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


class Stopwatch:
    """Time per optimizer step, with evaluation and checkpoint pauses left out."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self._unusual: set[int] = {0}
        """Steps left out of the median: the first (one-off costs), the measured one."""
        self._last_step_end = self._window_start = time.perf_counter()

    def lap(self) -> None:
        """An optimizer step ended now."""
        now = time.perf_counter()
        self.step_seconds.append(now - self._last_step_end)
        self._last_step_end = now

    def leave_out_last(self) -> None:
        """The last step was slowed on purpose (memory measured by kind): not a typical step."""
        self._unusual.add(len(self.step_seconds) - 1)

    def window_seconds(self) -> float:
        """Training time since the previous call (the log window), and start a new window."""
        now = time.perf_counter()
        elapsed, self._window_start = now - self._window_start, now
        return elapsed

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work in this block (evaluation, saving) is not training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            pause = time.perf_counter() - start
            self._last_step_end += pause
            self._window_start += pause

    def recent_mean(self, count: int) -> float:
        """Mean of the last ``count`` step times (0 before the first step)."""
        recent = self.step_seconds[-count:]
        return statistics.fmean(recent) if recent else 0.0

    @property
    def train_seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def median_step_seconds(self) -> float:
        """The first step pays one-off costs (allocations, lazy state init) and the measured
        one the tracker's: both are left out (unless nothing else is left)."""
        usual = [t for i, t in enumerate(self.step_seconds) if i not in self._unusual]
        return statistics.median(usual or self.step_seconds[1:] or self.step_seconds or [0.0])
