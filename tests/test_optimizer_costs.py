"""The registry's "bytes/param" column is a measurement, not a claim: each installed optimizer is
built over the distilbert-base preset (65.8M parameters), stepped once, and its state measured by
the true-storage ledger must give the figure the registry (and ``effitrain optimizers``) shows."""

from __future__ import annotations

import copy
import re

import pytest

from effitrain.config import TrainConfig
from effitrain.memory import ledger as memory
from effitrain.optim import OPTIMIZERS, build_optimizer, get_spec, set_train_mode


@pytest.fixture(scope="module")
def distilbert_base():
    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from effitrain.models import preset_settings

    torch.manual_seed(0)
    return DistilBertForSequenceClassification(
        DistilBertConfig(**preset_settings("distilbert-base"), num_labels=2)
    )


def measured_bytes_per_param(model, name: str) -> float:
    import torch

    spec = get_spec(name)
    optimizer = build_optimizer(model, name, spec.fine_tune.lr, TrainConfig().weight_decay)
    set_train_mode(optimizer, True)  # as a run does (schedule-free refuses to step otherwise)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=input_ids, labels=torch.tensor([0, 1])).loss.backward()
    optimizer.step()
    ledger = memory.optimizer_state_ledger(optimizer)
    return ledger.bytes / memory.trainable_parameter_count(model)


def claimed_bytes_per_param(name: str) -> float:
    match = re.match(r"\s*(\d+(?:\.\d+)?)", get_spec(name).bytes_per_param)
    assert match, f"{name}: bytes_per_param must start with the measured figure"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_registry_bytes_per_param_is_the_measured_figure(distilbert_base, name):
    if not get_spec(name).is_available():
        pytest.skip(f"{name}: {get_spec(name).install}")
    measured = measured_bytes_per_param(copy.deepcopy(distilbert_base), name)
    assert round(measured, 2) == pytest.approx(claimed_bytes_per_param(name)), measured


def test_claimed_figures_are_numbers():
    for name in OPTIMIZERS:
        assert claimed_bytes_per_param(name) >= 0
