"""How each optimizer is made: one factory per library class (the library imported inside it, so
a missing extra is one clear message when the optimizer is chosen), the FSDP2 variant of the
factored ones (:func:`for_sharding`), and the train/eval switch some of them have."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.memory.ledger import unwrap_prepared

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from effitrain.optim.optimizer_spec import OptimizerSpec, ParamGroups


def adamw(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(groups, lr=lr)


def adafactor(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    # lr caps a *relative* step: step size = max(eps2, RMS(param)) * min(lr, 1/sqrt(t)).
    return torch.optim.Adafactor(groups, lr=lr)


def adafactor_hf(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # The Trainer's optim="adafactor": a plain lr, no relative step, no parameter scaling.
    return Adafactor(groups, lr=lr, relative_step=False, scale_parameter=False, warmup_init=False)


def adamw_8bit(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    # bitsandbytes logs a warning about an optional 4-bit CPU kernel on import; it does not
    # concern 8-bit optimizers, so keep it out of the user's console.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    with _maps_made_once(bnb):
        return bnb.optim.AdamW8bit(groups, lr=lr)


_DYNAMIC_MAPS: dict[tuple[Any, ...], list[float]] = {}
"""bitsandbytes' dynamic quantization maps' values, by ``create_dynamic_map``'s arguments."""


@contextmanager
def _maps_made_once(bnb: ModuleType) -> Iterator[None]:
    """bitsandbytes' 8-bit optimizers each make their quantization maps (256 values) from
    dozens of small tensors read back with ``.tolist()``: on the estimate's fake tensors about
    30 ms an optimizer, and --optimizer-in-backward makes one per parameter. Inside, each map's
    values are made once per process, for real; each optimizer still gets tensors of its own
    (its state holds them, as in a run that makes them)."""
    from unittest import mock

    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = bnb.functional.create_dynamic_map

    def made(*args: Any, **kwargs: Any) -> torch.Tensor:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _DYNAMIC_MAPS:
            with unset_fake_temporarily():
                _DYNAMIC_MAPS[key] = original(*args, **kwargs).tolist()
        return torch.tensor(_DYNAMIC_MAPS[key], dtype=torch.float32)

    with mock.patch.object(bnb.functional, "create_dynamic_map", made):
        yield


def adam_mini(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.adam_mini import build

    return build(model, groups, lr)


def torchao(class_name: str) -> Callable[[ParamGroups, float], torch.optim.Optimizer]:
    def factory(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
        from effitrain.optim.low_bit import build

        return build(class_name, groups, lr)

    return factory


def sgd(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def muon(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_muon

    return build_muon(model, groups, lr)


def galore(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_galore

    return build_galore(model, groups, lr)


def apollo(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_apollo

    return build_apollo(model, groups, lr)


def apollo_mini(model: torch.nn.Module, groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from effitrain.optim.split import build_apollo

    return build_apollo(model, groups, lr, mini=True)


def by_model_only(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    raise EffitrainError("this optimizer is built over the model (OptimizerSpec.model_factory)")


def lion(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    # Plain torch (its optional Triton kernel off): runs on FSDP2's DTensors, unlike bnb's Lion.
    return Lion(groups, lr=lr)


def lion_8bit(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    with _maps_made_once(bnb):
        return bnb.optim.Lion8bit(groups, lr=lr)


CAME_BETAS = (0.9, 0.999, 0.99)
"""CAME's betas here: its third (the confidence average's) at 0.99, not its paper's 0.9999.

None of CAME's moments is bias-corrected and its update divides by the root of the confidence
average, which starts at ``1 - beta3**t`` of its settled value: at 0.9999 early updates are many
times larger than the lr says for thousands of steps (see docs/optimizers.md).
"""


def came(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from pytorch_optimizer import CAME

    return CAME(groups, lr=lr, betas=CAME_BETAS)


def adamw_schedule_free(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    # No internal warmup_steps: effitrain's "constant" schedule warms up through the lr, which
    # schedule-free follows the same way (lr_max and the average's weights), and it is logged.
    return AdamWScheduleFree(groups, lr=lr)


def set_train_mode(optimizer: Any, train: bool) -> None:
    """``optimizer.train()`` or ``.eval()`` where it has them (schedule-free: eval mode holds the
    averaged weights, the ones to evaluate and save); otherwise nothing.

    Unwraps Accelerate's ``AcceleratedOptimizer`` (``.optimizer``) and reaches the per-parameter
    optimizers of ``--optimizer-in-backward`` (``.optimizers``).
    """
    inner = unwrap_prepared(optimizer)
    if inner is not optimizer:
        set_train_mode(inner, train)
        return
    optimizers = getattr(optimizer, "optimizers", None)
    if isinstance(optimizers, dict):
        for each in optimizers.values():
            set_train_mode(each, train)
        return
    method = getattr(optimizer, "train" if train else "eval", None)
    if callable(method):
        method()


def for_sharding(spec: OptimizerSpec, dtensor_params: bool) -> OptimizerSpec:
    """The spec to build when the optimizer will see FSDP2's DTensor parameters: the factored
    optimizers become :mod:`effitrain.optim.fsdp2`'s classes (the libraries' own crash there),
    with the registry's hyperparameters; any other spec as it is."""
    from effitrain.distributed import FACTORED_OPTIMIZERS

    if not dtensor_params or spec.name not in FACTORED_OPTIMIZERS:
        return spec
    name, library_factory = spec.name, spec.factory

    def factory(groups: ParamGroups, lr: float) -> torch.optim.Optimizer:
        from effitrain.optim.fsdp2 import build

        return build(name, library_factory, groups, lr)

    return dataclasses.replace(
        spec,
        class_path=f"effitrain.optim.fsdp2 ({spec.class_path}, on each rank's FSDP2 shard)",
        factory=factory,
    )
