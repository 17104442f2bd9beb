"""The memory levers (effitrain.levers): each one trains, checkpoints, resumes exactly, shows
its saving in the memory breakdown, and every refused combination is one clean error."""

from __future__ import annotations

import json

import pytest

from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import assert_identical, load_tensors, train_args, write_data
from tests.test_resume import assert_same_end, straight_and_resumed


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("levers") / "data")


def run_metrics(train_cli, data, out, *options):
    proc = train_cli(
        *train_args(data, out, "--max-steps", "3", "--metrics-json", str(out / "m.json"), *options)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((out / "m.json").read_text())


# --- gradient checkpointing -------------------------------------------------------------------


def test_gradient_checkpointing_keeps_the_maths_and_saves_activations(train_cli, data, tmp_path):
    _, plain = run_metrics(train_cli, data, tmp_path / "plain")
    proc, checkpointed = run_metrics(
        train_cli, data, tmp_path / "checkpointed", "--gradient-checkpointing"
    )
    assert "lever     gradient checkpointing (non-reentrant" in proc.stdout
    assert "Memory (gradient-checkpointing)" in proc.stdout
    assert checkpointed["levers"] == ["gradient-checkpointing"] and plain["levers"] == []
    # Recomputing forward in backward (dropout replayed with the same RNG) changes no number.
    assert_identical(
        load_tensors(tmp_path / "plain" / "final"),
        load_tensors(tmp_path / "checkpointed" / "final"),
    )
    assert checkpointed["train_loss"] == plain["train_loss"]
    # Activations: only the layers' inputs are kept through forward, one layer's are
    # recomputed at a time in backward.
    assert checkpointed["activation_bytes"] < 0.8 * plain["activation_bytes"]
    assert checkpointed["peak_tensor_bytes"] < plain["peak_tensor_bytes"]
    for key in ("parameter_bytes", "gradient_bytes"):
        assert checkpointed[key] == plain[key]
    assert checkpointed["optimizer_state"]["bytes"] == plain["optimizer_state"]["bytes"]


def test_gradient_checkpointing_resumes_exactly(train_cli, data, tmp_path):
    options = ("--gradient-checkpointing", "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


def test_a_model_without_gradient_checkpointing_is_refused():
    import torch

    from effitrain.levers import enable_gradient_checkpointing

    with pytest.raises(EffitrainError, match="Linear does not support gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
