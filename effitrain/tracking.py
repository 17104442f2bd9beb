"""``--report-to``: Accelerate's experiment trackers (``log_with``, ``init_trackers``,
``accelerator.log``) follow a run: the config once, each log line's loss, lr and speed, each
evaluation, and the memory figures at the end. A run holds one :class:`Trackers`; every method
does nothing without trackers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from effitrain.report.live import Reporter
    from effitrain.results import StepLog, TrainResult

PROJECT = "effitrain"
"""The project name trackers get (W&B project, MLflow experiment, TensorBoard's subfolder)."""


def check(config: TrainConfig) -> None:
    """Refuse a ``--report-to`` tracker that cannot start, before anything is built (Accelerate
    itself skips a tracker whose package is missing, silently).

    Raises:
        EffitrainError: its package is not installed, or this Accelerate does not know it.
    """
    import accelerate
    from accelerate import utils
    from accelerate.tracking import get_available_trackers

    for name in config.trackers:
        if name == "all":
            if not get_available_trackers():
                raise EffitrainError(
                    "--report-to all found no tracker installed: pip install tensorboard"
                )
        elif name not in utils.LoggerType.list():
            raise EffitrainError(
                f"--report-to {name} needs a newer accelerate than {accelerate.__version__}: "
                "pip install -U accelerate"
            )
        elif not getattr(utils, f"is_{name}_available")():
            raise EffitrainError(
                f"--report-to {name} needs the '{name}' package: pip install {name}"
            )


class Trackers:
    """The run's ``--report-to`` trackers, through its accelerator."""

    def __init__(self, accelerator: Accelerator | None, config: TrainConfig) -> None:
        self.accelerator = accelerator
        self.config = config
        self.on = bool(config.trackers) and accelerator is not None

    def start(self, global_step: int, reporter: Reporter) -> None:
        """Start the trackers (on the main process: Accelerate's rule) with the config, and say
        where they log. ``global_step``: where a resumed run continues."""
        if not self.on:
            return
        init_kwargs: dict[str, dict[str, Any]] = {}
        if global_step:
            # Resumed: TensorBoard hides what the earlier run logged after its checkpoint.
            init_kwargs["tensorboard"] = {"purge_step": global_step + 1}
        accelerator = self.accelerator
        accelerator.init_trackers(
            PROJECT, config=tracker_config(self.config), init_kwargs=init_kwargs
        )
        # Trackers that write locally name their folder (TensorBoard: logging_dir/project).
        folders = {
            tracker.name: getattr(tracker, "logging_dir", None) for tracker in accelerator.trackers
        }
        names = [f"{name} ({folder})" if folder else name for name, folder in folders.items()]
        reporter.note(f"logging to {', '.join(names)}")

    def log_train(self, log: StepLog) -> None:
        """One log line's loss, lr, speed and the loss's window metrics (Python floats the loop
        already has: no sync)."""
        if self.on:
            values = {
                "train/loss": log.loss,
                "train/lr": log.lr,
                "train/samples_per_second": log.samples_per_second,
                "train/tokens_per_second": log.tokens_per_second,
                "train/epoch": log.epoch,
                **{f"train/{name}": value for name, value in log.metrics.items()},
            }
            self.accelerator.log(values, step=log.step)

    def log_evaluation(self, metrics: dict[str, float], step: int) -> None:
        if self.on:
            self.accelerator.log(
                {
                    f"eval/{k}": v
                    for k, v in metrics.items()
                    if k in ("loss", "accuracy", "f1", "perplexity")
                    or k.startswith("rewards/")
                    or k.startswith("logps/")
                },
                step=step,
            )

    def finish(self, result: TrainResult) -> None:
        """The run's memory figures, once, at its last step (this process's, like the table);
        then close the trackers."""
        if not self.on:
            return
        memory = result.memory
        optional = (
            ("activation_bytes", memory.activation_bytes),
            ("peak_tensor_bytes", memory.peak_tensor_bytes),
        )
        self.accelerator.log(
            {
                "memory/optimizer_state_bytes": memory.optimizer_state.bytes,
                "memory/adamw_equivalent_bytes": memory.adamw_equivalent_bytes,
                "memory/parameter_bytes": memory.parameter_bytes,
                "memory/gradient_bytes": memory.gradient_bytes,
                "memory/peak_memory_bytes": result.peak_memory_bytes,
                **{f"memory/{name}": value for name, value in optional if value is not None},
            },
            step=result.global_steps,
        )
        # After the last collective: this also ends the process group, on every process.
        self.accelerator.end_training()


def tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The options as trackers' hyperparameters take them: scalars and strings, lists joined."""
    return {
        name: ",".join(value) if isinstance(value, list) else value
        for name, value in config.to_dict().items()
    }
