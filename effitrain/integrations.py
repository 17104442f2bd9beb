"""effitrain's optimizer-memory numbers inside a ``transformers.Trainer`` run.

::

    from effitrain.integrations import EffitrainMemoryCallback

    trainer = Trainer(..., callbacks=[EffitrainMemoryCallback()])
    trainer.train()   # prints the optimizer-state table; the numbers join the final train log

Importing this module imports ``transformers`` (the callback subclasses ``TrainerCallback``);
nothing else in effitrain imports it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from effitrain.python_api import OptimizerMemory, optimizer_memory

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

__all__ = ["EffitrainMemoryCallback", "add_memory_callback"]

logger = logging.getLogger(__name__)

TRAIN_SUMMARY_KEY = "train_runtime"
"""Present only in the log the Trainer writes once training is over (with ``train_loss``)."""


class EffitrainMemoryCallback(TrainerCallback):
    """Measure the optimizer's true state when ``trainer.train()`` ends, log it, print it.

    Where the numbers go: the Trainer logs its training summary (``train_runtime``,
    ``train_loss`` …) once, after the last step, through ``Trainer.log``, which first appends
    a *copy* of the dict to ``state.log_history`` and then hands the dict itself to each
    callback's ``on_log`` in list order. On that log this callback adds
    ``optimizer_state_bytes``, ``optimizer_state_elements``, ``adamw_equivalent_bytes`` and
    ``adamw_equivalent_elements`` to the dict and to the copy, so they end up in

    - ``trainer.state.log_history[-1]`` (written out by ``trainer.save_state()``);
    - the ``metrics`` of the ``TrainOutput`` that ``trainer.train()`` returns (the same dict);
    - every callback after this one, the Trainer's progress printer included.

    ``report_to`` integrations (TensorBoard, W&B, MLflow …) come *before* the callbacks passed
    to ``Trainer(callbacks=...)`` and have already sent that log when this one runs; to have
    them record the numbers as well, add the callback with :func:`add_memory_callback`, which
    puts it ahead of them.

    At ``on_train_end`` the main process (``state.is_world_process_zero``) prints the table
    ``effitrain train`` prints and the comparison with AdamW. The measurement is kept in
    :attr:`result`. Under FSDP or ZeRO the numbers are this process's shard. An optimizer
    it cannot read (no ``state`` mapping, as with some DeepSpeed wrappers) gets a warning, not
    an exception: training is over by then and ``train()`` should still return.

    Args:
        console: a rich Console to print to (default: stdout).
        print_table: False to only log the numbers.
    """

    def __init__(self, console: Console | None = None, print_table: bool = True):
        self.console = console
        self.print_table = print_table
        self.result: OptimizerMemory | None = None  # set when training ends

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or TRAIN_SUMMARY_KEY not in logs:
            return
        self.result = self._measure(optimizer)
        if self.result is None:
            return
        numbers = self.result.metrics()
        logs.update(numbers)
        # Trainer.log appended {**logs, "step": ...} to the history just before calling on_log.
        if state.log_history and TRAIN_SUMMARY_KEY in state.log_history[-1]:
            state.log_history[-1].update(numbers)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.result is None:
            self.result = self._measure(optimizer)
        if self.print_table and self.result is not None and state.is_world_process_zero:
            self.result.print_table(self.console)

    @staticmethod
    def _measure(optimizer: Any) -> OptimizerMemory | None:
        if optimizer is None:
            return None
        try:
            return optimizer_memory(optimizer)
        except TypeError as exc:
            logger.warning("effitrain: optimizer state not measured: %s", exc)
            return None


def add_memory_callback(
    trainer: Trainer, callback: EffitrainMemoryCallback | None = None
) -> EffitrainMemoryCallback:
    """Add an :class:`EffitrainMemoryCallback` ahead of the Trainer's ``report_to``
    integrations, so that they log its numbers too; returns it.

    ``Trainer.add_callback`` and ``Trainer(callbacks=...)`` append after the integrations.
    """
    callback = callback or EffitrainMemoryCallback()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
