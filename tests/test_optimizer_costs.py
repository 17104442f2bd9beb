"""The registry's "bytes/param" column is a measurement, not a claim: each installed optimizer is
built over the distilbert-base preset (65.8M parameters), stepped once, and its state measured by
the true-storage ledger must give the figure the registry (and ``effitrain optimizers``) shows.

The state's layout follows from the parameters' shapes and names, not from their values: the
model is allocated without initialising it (``to_empty``) and stepped on zero gradients instead
of a forward and backward pass. torchao's optimizers allocate their state (its quantize-or-not
rule included) before their compiled update, which is not run here: the update writes into that
state in place (test_optim_ao.py checks the state after real compiled steps).
"""

from __future__ import annotations

import re

import pytest

from effitrain.config import TrainConfig
from effitrain.memory import ledger as memory
from effitrain.optim import OPTIMIZERS, build_optimizer, get_spec, set_train_mode


def measured_bytes_per_param(name: str) -> float:
    from contextlib import nullcontext
    from unittest import mock

    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from effitrain.models import preset_settings

    config = DistilBertConfig(**preset_settings("distilbert-base"), num_labels=2)
    with torch.device("meta"):
        model = DistilBertForSequenceClassification(config)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    spec = get_spec(name)
    optimizer = build_optimizer(model, name, spec.fine_tune.lr, TrainConfig().weight_decay)
    set_train_mode(optimizer, True)  # as a run does (schedule-free refuses to step otherwise)
    skip_compiled_update = (
        mock.patch.object(torch, "compile", lambda *_a, **_k: lambda *_a, **_k: None)
        if spec.module == "torchao"
        else nullcontext()
    )
    with skip_compiled_update:
        optimizer.step()
    ledger = memory.optimizer_state_ledger(optimizer)
    assert ledger.params_with_state == len(list(model.parameters()))
    return ledger.bytes / memory.trainable_parameter_count(model)


def claimed_bytes_per_param(name: str) -> float:
    match = re.match(r"\s*(\d+(?:\.\d+)?)", get_spec(name).bytes_per_param)
    assert match, f"{name}: bytes_per_param must start with the measured figure"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_registry_bytes_per_param_is_the_measured_figure(name):
    if not get_spec(name).is_available():
        pytest.skip(f"{name}: {get_spec(name).install}")
    measured = measured_bytes_per_param(name)
    assert round(measured, 2) == pytest.approx(claimed_bytes_per_param(name)), measured


def test_claimed_figures_are_numbers():
    for name in OPTIMIZERS:
        assert claimed_bytes_per_param(name) >= 0
