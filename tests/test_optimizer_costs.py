"""The "bytes/param" of ``effitrain optimizers`` is a measurement, not a claim: each installed
optimizer is built over the distilbert-base preset (65.8M parameters), stepped once, and its state
measured by the true-storage ledger must give the figure of effitrain/optim/state_bytes.json
(rendered from benchmarks/optimizer_costs/results.json; benchmarks/test_common.py checks it fresh).

The state's layout follows from the parameters' shapes and names, not from their values: the
model is allocated without initialising it (``to_empty``) and stepped on zero gradients instead
of a forward and backward pass, and GaLore's SVD of each gradient (whose values only choose the
projection) is replaced by zero factors of the shapes and column-major layout LAPACK returns
(:func:`shapes_only`). torchao's optimizers allocate their state (its quantize-or-not
rule included) before their compiled update, which is not run here: the update writes into that
state in place (test_optim_ao.py checks the state after steps traced as torchao compiles them).
"""

from __future__ import annotations

import re

import pytest

from effitrain.config import TrainConfig
from effitrain.memory import ledger as memory
from effitrain.optim import (
    OPTIMIZERS,
    build_optimizer,
    get_spec,
    measured_state_bytes,
    set_train_mode,
    state_bytes_per_param,
)


def shapes_only(svd):
    """``svd`` (``torch.linalg.svd``) giving zeros: U, S and Vh of the shapes its meta kernel
    gives, U and Vh column-major as LAPACK's are (so that a slice of them is the same view)."""
    import torch

    def factors(matrix, full_matrices: bool = True, **options):
        u, s, vh = svd(matrix.to("meta"), full_matrices=full_matrices, **options)
        like = {"dtype": matrix.dtype, "device": matrix.device}
        column_major = [torch.zeros(t.shape[::-1], **like).mT for t in (u, vh)]
        return column_major[0], torch.zeros(s.shape, **like), column_major[1]

    return factors


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
    with (
        skip_compiled_update,
        mock.patch.object(torch.linalg, "svd", shapes_only(torch.linalg.svd)),
    ):
        optimizer.step()
    ledger = memory.optimizer_state_ledger(optimizer)
    assert ledger.params_with_state == len(list(model.parameters()))
    return ledger.bytes / memory.trainable_parameter_count(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_published_figure_is_the_measured_one(name):
    if not get_spec(name).is_available():
        pytest.skip(f"{name}: {get_spec(name).install}")
    published = state_bytes_per_param(name)
    assert published is not None, f"{name}: not in effitrain/optim/state_bytes.json"
    measured = measured_bytes_per_param(name)
    assert round(measured, 2) == pytest.approx(published), measured


def test_every_optimizer_has_a_measured_figure_and_no_literal_one():
    settings = measured_state_bytes()["settings"]
    assert (settings["model"], settings["weights"]) == ("distilbert-base", "fp32")
    for name, spec in OPTIMIZERS.items():
        figure = state_bytes_per_param(name)
        assert isinstance(figure, float) and figure >= 0, (name, figure)
        # The note explains the figure; the figure itself lives only in the data file.
        assert not re.match(r"\s*\d", spec.state_bytes_note), (name, spec.state_bytes_note)
