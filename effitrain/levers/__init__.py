"""The memory levers: one :class:`~effitrain.levers.spec.Lever` spec per lever, in one registry.

=========================  ===============================  =====================================
lever (name in metrics)    option                           what it removes
=========================  ===============================  =====================================
load-in-4bit               ``--load-in-4bit`` (QLoRA)       7/8 of the frozen base's Linear weights
bf16-weights               ``--weights-dtype bf16``         half of parameters, gradients, state
gradient-checkpointing     ``--gradient-checkpointing``     most activations (recomputed)
tiled-mlp                  ``--tiled-mlp`` (causal-lm,      the MLPs' intermediates but one
                           preference)                      sequence tile's (recomputed)
tiled-norm                 ``--tiled-norm`` (causal-lm,     the RMSNorms' fp32 copies but one
                           preference)                      sequence tile's (recomputed)
lora                       ``--lora-rank R``                gradients and state of the base model
lean-lora                  ``--lean-lora`` (with LoRA)      the adapters' copies of their inputs
                                                            (recomputed)
chunked-loss               ``--chunked-loss`` (causal-lm)   the full logits
activation-offload         ``--activation-offload``         saved activations from the GPU (CUDA)
optimizer-in-backward      ``--optimizer-in-backward``      the full set of gradients
optimizer-offload          ``--optimizer-offload state``    optimizer state from the GPU (CUDA;
                                                            ``state+grads``: gradients too)
reference                  ``--reference`` (preference,     DPO's second model (adapters off,
                           dpo)                             precomputed log-probs, or a copy)
context-parallel           ``--context-parallel N``         activations: 1/N of each sequence per
                           (causal-lm, FSDP2, CUDA)         rank (ring attention)
=========================  ===============================  =====================================

The registry's order is the order levers act in (quantize, then cast, then checkpointing, then
LoRA's wrapper). The functions below are the moments a run (and ``effitrain estimate``, which
builds the same run on fake tensors) calls the levers at; each calls every lever that is on.
Adding a lever is one module here (its options and its spec), one line in the ``register``
call below, its docs and its tests.

Nothing heavy is imported here: the CLI checks options through this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.config import add_options, default_for
from effitrain.errors import EffitrainError
from effitrain.levers.activation_offload import ActivationOffload
from effitrain.levers.bf16_weights import Bf16Weights
from effitrain.levers.chunked_loss import ChunkedLoss
from effitrain.levers.context_parallel import ContextParallel
from effitrain.levers.gradient_checkpointing import GradientCheckpointing
from effitrain.levers.lean_lora import LeanLoRA
from effitrain.levers.lora import LoRA
from effitrain.levers.optimizer_in_backward import OptimizerInBackward
from effitrain.levers.optimizer_offload import OptimizerOffload
from effitrain.levers.qlora import QLoRA
from effitrain.levers.reference import Reference
from effitrain.levers.spec import Lever, LossOptions, OptimizerBuilder
from effitrain.levers.tiled_mlp import TiledMLP
from effitrain.levers.tiled_norm import TiledNorm

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.models import LoadOptions
    from effitrain.optim import OptimizerSpec
    from effitrain.parts import RunParts
    from effitrain.report.live import Reporter
    from effitrain.results import MemoryRow

LEVERS: dict[str, Lever] = {}
"""Every lever by its metrics name, in the order they act."""


def register(*levers: Lever) -> None:
    """Add ``levers`` to :data:`LEVERS`, after those there (they act after them): their options
    become config fields, CLI options and YAML keys (``effitrain.config.add_options``); the
    registry's functions below, ``effitrain estimate`` and ``effitrain plan``'s search (what each
    spec declares) take them from then on. Register before the CLI's commands are imported:
    they read the option table once.

    Raises:
        ValueError: a name or an option that is registered already.
    """
    for lever in levers:
        if lever.name in LEVERS:
            raise ValueError(f"lever {lever.name!r} is registered already")
    add_options(*(lever.options for lever in levers))
    LEVERS.update({lever.name: lever for lever in levers})


register(
    QLoRA(),
    Bf16Weights(),
    GradientCheckpointing(),
    TiledMLP(),
    TiledNorm(),
    LoRA(),
    LeanLoRA(),
    ChunkedLoss(),
    ActivationOffload(),
    OptimizerInBackward(),
    OptimizerOffload(),
    Reference(),
    ContextParallel(),
)

__all__ = ["LEVERS", "Lever", "get_lever", "register"]


def get_lever(name: str) -> Lever:
    """The lever called ``name``; an unknown name lists the valid ones."""
    try:
        return LEVERS[name]
    except KeyError:
        raise EffitrainError(
            f"unknown lever '{name}'; choose one of: {', '.join(LEVERS)}"
        ) from None


def lever_of(field_name: str) -> Lever | None:
    """The lever that owns a config field, or None."""
    return next((lever for lever in LEVERS.values() if field_name in lever.fields), None)


def active(config: TrainConfig) -> list[Lever]:
    """The levers the options turn on, in registry order."""
    return [lever for lever in LEVERS.values() if lever.is_on(config)]


def _given(lever: Lever, config: TrainConfig) -> bool:
    """Whether any of the lever's options differs from its default."""
    return any(getattr(config, name) != default_for(name) for name in lever.fields)


# -- before anything is built ---------------------------------------------------------------


def check_options(config: TrainConfig) -> None:
    """Every lever's checks (its values, the other levers, the optimizer), before anything is
    loaded.

    Raises:
        EffitrainError: one line naming the options.
    """
    for lever in LEVERS.values():
        if lever.is_on(config) or _given(lever, config):
            lever.check(config)


def check_task(config: TrainConfig, task: str) -> None:
    """Refuse the options of a lever that ``task`` cannot take."""
    for lever in LEVERS.values():
        if _given(lever, config):
            lever.check_task(config, task)


def device_needed(config: TrainConfig) -> str | None:
    """The device type the levers that are on need (the first such lever's), else None."""
    return next((lever.devices[0] for lever in active(config) if lever.devices), None)


def check_launch(config: TrainConfig, launch: Launch) -> None:
    """Refuse what the launch rules out, for every lever that is on."""
    for lever in active(config):
        lever.check_launch(config, launch)


# -- building -------------------------------------------------------------------------------


def load_options(config: TrainConfig, options: LoadOptions) -> LoadOptions:
    """How the checkpoint is read, once every lever has said what it changes."""
    for lever in active(config):
        options = lever.load_options(config, options)
    return options


def apply_to_model(
    model: torch.nn.Module, config: TrainConfig, device: torch.device | None = None
) -> torch.nn.Module:
    """Turn on the levers that change the model, in registry order; returns the model to train
    (LoRA wraps it). ``device``: where the run trains (4-bit weights are quantized there; on
    the meta device, an estimate's, they are not quantized yet).

    Raises:
        EffitrainError: the model cannot take a lever (e.g. no gradient checkpointing).
    """
    on = active(config)
    for lever in on:
        model = lever.apply_to_model(model, config, device)
    for lever in on:
        lever.finish_model(model, config)
    return model


def for_launch(model: torch.nn.Module, config: TrainConfig, launch: Launch) -> None:
    """What each lever that is on changes in the model (levers applied) for ``launch``, before
    the optimizer is built and Accelerate prepares it."""
    for lever in active(config):
        lever.for_launch(model, config, launch)


def loss_options(config: TrainConfig) -> LossOptions:
    """What the levers that are on ask of the task's loss."""
    options = LossOptions()
    for lever in active(config):
        options = lever.loss_options(config, options)
    return options


def optimizer_spec(spec: OptimizerSpec, config: TrainConfig) -> OptimizerSpec:
    """The optimizer spec to build, once every lever has put its variant in place."""
    for lever in active(config):
        spec = lever.optimizer_spec(spec, config)
    return spec


def optimizer_builder(config: TrainConfig, estimating: bool = False) -> OptimizerBuilder | None:
    """How the lever that builds the optimizer builds it (the levers that do refuse each
    other); None: the spec's own factory."""
    builders = [lever.optimizer_builder(config, estimating) for lever in active(config)]
    builders = [builder for builder in builders if builder is not None]
    return builders[0] if builders else None


def max_grad_norm(config: TrainConfig) -> float:
    """``--max-grad-norm`` as used: the value given, else 1.0 (0, no clipping, with a lever
    that runs part of the step inside backward, before clipping could see every gradient:
    ``Lever.in_backward``)."""
    if config.max_grad_norm is not None:
        return config.max_grad_norm
    return 0.0 if any(lever.in_backward for lever in active(config)) else 1.0


def updates_in_backward(config: TrainConfig) -> bool:
    """Whether the update itself runs inside backward, before the step's guard sees the loss
    (``Lever.in_backward``: ``--optimizer-in-backward``'s)."""
    return any(lever.in_backward == "update" for lever in active(config))


def trains_adapters(config: TrainConfig) -> bool:
    """Whether the trained parameters are new adapters (the optimizers' LoRA defaults)."""
    return any(lever.trains_adapters for lever in active(config))


def after_prepare(run: RunParts) -> None:
    for lever in active(run.config):
        lever.after_prepare(run)


def step_contexts(
    config: TrainConfig, model: torch.nn.Module, estimating: bool = False
) -> dict[str, Any]:
    """The contexts around each micro-batch's forward and backward, by lever name."""
    contexts = {}
    for lever in active(config):
        context = lever.step_context(config, model, estimating)
        if context is not None:
            contexts[lever.name] = context
    return contexts


def batch_contexts(run: RunParts, batch: dict[str, Any]) -> list[Any]:
    """The contexts around one micro-batch's forward and backward that need the batch."""
    contexts = [lever.batch_context(run, batch) for lever in active(run.config)]
    return [context for context in contexts if context is not None]


def step_cost(run: RunParts, micro_batches: int) -> dict[str, int]:
    """The levers' parts of an optimizer step's cost (``Lever.step_cost``), summed by field."""
    cost: dict[str, int] = {}
    for lever in active(run.config):
        for name, value in lever.step_cost(run, micro_batches).items():
            cost[name] = cost.get(name, 0) + value
    return cost


def finish_steps(run: RunParts) -> None:
    for lever in active(run.config):
        lever.finish_steps(run)


def fake_tensor(config: TrainConfig, original: Any, empty: Any) -> Any | None:
    """``effitrain estimate``: what stands for ``original`` on fake tensors, where a lever made
    it (None: a plain fake tensor)."""
    for lever in active(config):
        made = lever.fake_tensor(original, empty)
        if made is not None:
            return made
    return None


# -- what is shown ---------------------------------------------------------------------------


def in_use(run: RunParts) -> list[str]:
    """The names of the levers in use in a built run (the metrics JSON's ``levers``)."""
    return [lever.name for lever in LEVERS.values() if lever.in_use(run)]


def banner_lines(config: TrainConfig, model: torch.nn.Module) -> list[str]:
    """One banner line per lever that has one (``model``: unwrapped)."""
    lines = [lever.banner(config, model) for lever in active(config)]
    return [line for line in lines if line]


def metrics(run: RunParts) -> dict[str, Any]:
    """The levers' fields of the metrics JSON, measured."""
    fields: dict[str, Any] = {}
    for lever in active(run.config):
        fields.update(lever.metrics(run))
    return fields


def memory_rows(fields: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
    """The levers' rows of the memory table, from their metrics fields and the measured step."""
    return [row for lever in LEVERS.values() for row in lever.memory_rows(fields, step)]


def host_step_bytes(config: TrainConfig, fields: dict[str, Any]) -> int:
    """What the levers that are on hold in host memory through a step on a GPU, from their
    metrics fields (``Lever.host_step_bytes``)."""
    return sum(lever.host_step_bytes(fields) for lever in active(config))


def estimate_notes(config: TrainConfig) -> list[str]:
    return [note for lever in active(config) for note in lever.estimate_notes(config)]


def original_parameters(model: torch.nn.Module) -> Any:
    """The parameters the model had before any lever added some (LoRA's adapters and head
    copies): what "the same model trained whole" trains."""
    from effitrain.levers.lora import original_parameters
    from effitrain.models import is_lora

    return original_parameters(model) if is_lora(model) else model


# -- checkpoints -----------------------------------------------------------------------------


def strict_load(config: TrainConfig) -> bool:
    """Whether Accelerate checks every key when a checkpoint's model loads."""
    return all(lever.strict_load for lever in active(config))


def check_checkpoint(run: RunParts, checkpoint: Path) -> None:
    for lever in active(run.config):
        lever.check_checkpoint(run, checkpoint)


def after_final_save(run: RunParts, reporter: Reporter) -> None:
    for lever in active(run.config):
        lever.after_final_save(run, reporter)
