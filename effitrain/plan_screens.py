"""The plan's layer screens: a configuration's figures estimated with the model cut to one and
to two layers, extended along that line to the model's depth (a decoder's layers are alike, so
every part of a step grows by the same amount per layer), and what a full estimate's peak per
device is."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from effitrain.cost import StepCost
from effitrain.results import Estimate

LAYER_FIELDS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
"""Where a transformers config keeps its number of layers."""


@dataclasses.dataclass(frozen=True)
class Screen:
    """A lever set's estimate at micro-batch 1 with its reference optimizer, at full depth."""

    peak: int
    static: int
    """Parameters, gradients and optimizer state (per device): what the batch does not change."""
    state: int
    parameters: int
    trainable: int
    cost: StepCost | None


def device_peak(result: Estimate) -> int:
    """An estimate's peak tensor bytes per device (the whole run's where it has one device)."""
    if result.per_device is not None and result.per_device.peak_tensor_bytes is not None:
        return result.per_device.peak_tensor_bytes
    return result.memory.peak_tensor_bytes or 0


def screen_of(result: Estimate) -> Screen:
    """An estimate's figures as a screen (per device where it has several)."""
    memory = result.memory
    per = result.per_device
    if per is not None:
        state = per.optimizer_state_bytes
        static = per.parameter_bytes + per.gradient_bytes + state
    else:
        state = memory.optimizer_state.bytes
        static = memory.parameter_bytes + memory.gradient_bytes + state
    parameters = per.parameter_bytes if per is not None else memory.parameter_bytes
    return Screen(
        device_peak(result), static, state, parameters, memory.trainable_parameters, result.cost
    )


def extend(one: Screen, two: Screen, depth: int) -> Screen:
    """The line through the one- and two-layer figures, at ``depth`` layers."""

    def at(a: int, b: int) -> int:
        return max(int(a + (b - a) * (depth - 1)), 0)

    cost = None
    if one.cost is not None and two.cost is not None:
        first, second = one.cost.to_dict(), two.cost.to_dict()
        cost = StepCost(**{k: at(first[k], second[k]) for k in first})
    return Screen(
        peak=at(one.peak, two.peak),
        static=at(one.static, two.static),
        state=at(one.state, two.state),
        parameters=at(one.parameters, two.parameters),
        trainable=at(one.trainable, two.trainable),
        cost=cost,
    )


@contextmanager
def cut_to(layers: int) -> Iterator[dict[str, int]]:
    """Models built from a config inside it have at most ``layers`` layers; the dict it gives
    gets the config's own count (``layers``) when one was cut."""
    from unittest import mock

    import transformers

    seen: dict[str, int] = {}

    def cutting(original: Any) -> Any:
        def from_config(model_config: Any, *args: Any, **kwargs: Any) -> Any:
            model_config = copy.deepcopy(model_config)
            for name in LAYER_FIELDS:
                count = getattr(model_config, name, None)
                if isinstance(count, int) and count > 0:
                    seen["layers"] = count
                    setattr(model_config, name, min(count, layers))
                    kinds = getattr(model_config, "layer_types", None)
                    if isinstance(kinds, list):
                        model_config.layer_types = kinds[:layers]
                    break
            return original(model_config, *args, **kwargs)

        return from_config

    with ExitStack() as stack:
        for auto in (
            transformers.AutoModelForCausalLM,
            transformers.AutoModelForSequenceClassification,
        ):
            stack.enter_context(mock.patch.object(auto, "from_config", cutting(auto.from_config)))
        yield seen
