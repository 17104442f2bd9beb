"""The memory levers: each one flag, checked before anything is built, applied in one place.

===========================  ===============================  ======================================
lever (name in the metrics)  option                           what it removes
===========================  ===============================  ======================================
gradient-checkpointing       ``--gradient-checkpointing``     most activations (recomputed in
                                                              backward)
optimizer-in-backward        ``--optimizer-in-backward``      the full set of gradients
bf16-weights                 ``--weights-dtype bf16``         half of parameters, gradients, state
lora                         ``--lora-rank R``                gradients and state of the base model
===========================  ===============================  ======================================

``TrainConfig.validate`` refuses lever values and combinations that cannot work, one line each,
before anything is built; :func:`check_launch` refuses what depends on how the run was launched; :func:`apply_to_model` turns the model-side levers on, between loading the model and
building the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    from effitrain.config import TrainConfig


def active(config: TrainConfig) -> list[str]:
    """The levers this run turns on, by their names in the metrics JSON (``levers``)."""
    names = []
    if config.gradient_checkpointing:
        names.append("gradient-checkpointing")
    if config.optimizer_in_backward:
        names.append("optimizer-in-backward")
    if config.weights_dtype == "bf16":
        names.append("bf16-weights")
    if config.lora_rank is not None:
        names.append("lora")
    return names


def check_launch(config: TrainConfig, state: Any) -> None:
    """Refuse levers that the launch (processes, FSDP, DeepSpeed) rules out.

    ``state`` is Accelerate's ``AcceleratorState``.

    Raises:
        EffitrainError: one line naming the lever and the launch.
    """
    if config.optimizer_in_backward:
        _check_in_backward_launch(state)


def _check_in_backward_launch(state: Any) -> None:
    """Optimizer step in backward runs each update in a post-accumulate-grad hook, which fires
    before DDP's all-reduce (the update would use this process's gradient alone), and FSDP and
    DeepSpeed own the parameters and their gradients."""
    from effitrain.distributed import detect_sharding

    sharding = detect_sharding(state)
    if sharding.kind != "single" or sharding.num_processes > 1:
        raise EffitrainError(
            f"--optimizer-in-backward cannot run on {sharding.description}: each update runs "
            "as soon as this process's gradient is ready, before the processes average their "
            "gradients; run one process, or drop --optimizer-in-backward"
        )


def apply_to_model(model: Any, config: TrainConfig, reporter: Any) -> Any:
    """Turn on the levers that change the model; returns the model to train (LoRA wraps it).
    ``reporter`` (:class:`effitrain.report.Reporter`) takes notes for the user.

    Raises:
        EffitrainError: the model cannot take a lever (e.g. no gradient checkpointing).
    """
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in backward: the model's own, non-reentrant
    implementation (the reentrant one needs inputs that require grad and breaks with frozen
    embeddings).

    Raises:
        EffitrainError: the architecture has no gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise EffitrainError(
            f"--gradient-checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing in transformers; drop the option or choose another model"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
