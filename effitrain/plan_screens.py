"""The plan's layer screens: a configuration's figures estimated with the model cut to one and
to two layers, extended along that line to the model's depth (a decoder's layers are alike, so
every part of a step grows by the same amount per layer), a screen's peak at a larger
micro-batch, and what a full estimate's peak per device is."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from effitrain.cost import StepCost
from effitrain.results import Estimate, peak_phase, step_peak

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
    phases: tuple[int, int] | None = None
    """A step in two phases (GRPO): the training phase's peak and the generation phase's
    (``peak`` is the larger); None: one phase."""

    def peak_at(self, units: int) -> int:
        """The peak at ``units`` times the screened micro-batch (:meth:`phase_peaks`)."""
        return step_peak(*self.phase_peaks(units))

    def peak_phase(self, units: int) -> str | None:
        """``generation`` or ``training``: the phase of :meth:`peak_at`'s peak (None: one
        phase)."""
        return peak_phase(*self.phase_peaks(units))

    def phase_peaks(self, units: int) -> tuple[int, int | None]:
        """The training and the generation phase's peaks (None: one phase) at ``units`` times
        the screened micro-batch: the parameters, gradients and state once, ``units`` times
        the rest (an upper bound: the rest is activations and working tensors, at most
        proportional to the tokens); generating holds the parameters and state, no
        gradients."""
        training = self.phases[0] if self.phases else self.peak
        at_training = self.static + units * max(training - self.static, 0)
        if self.phases is None:
            return at_training, None
        held = self.parameters + self.state
        return at_training, held + units * max(self.phases[1] - held, 0)


def device_peak(result: Estimate) -> int:
    """An estimate's peak tensor bytes per device (the whole run's where it has one device;
    a generation phase counted whole, as one process holds it without sharding)."""
    if result.per_device is not None and result.per_device.peak_tensor_bytes is not None:
        return step_peak(result.per_device.peak_tensor_bytes, result.memory.generation_peak_bytes)
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
    phases = None
    if memory.generation_peak_bytes is not None and memory.step_memory is not None:
        training = per.peak_tensor_bytes if per is not None else None
        phases = (training or memory.step_memory.peak_tensor_bytes, memory.generation_peak_bytes)
    return Screen(
        device_peak(result),
        static,
        state,
        parameters,
        memory.trainable_parameters,
        result.cost,
        phases,
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
        phases=(
            (at(one.phases[0], two.phases[0]), at(one.phases[1], two.phases[1]))
            if one.phases is not None and two.phases is not None
            else None
        ),
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
