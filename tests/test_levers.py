"""The memory levers (effitrain.levers): each one trains, checkpoints, resumes exactly, shows
its saving in the memory breakdown, and every refused combination is one clean error."""

from __future__ import annotations

import json

import pytest

from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import assert_identical, load_tensors, train_args
from tests.test_resume import assert_same_end, straight_and_resumed


def run_metrics(train_cli, data, out, *options):
    proc = train_cli(
        *train_args(data, out, "--max-steps", "3", "--metrics-json", str(out / "m.json"), *options)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((out / "m.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory, data):
    """The lever-free run the levers are measured against (3 steps): its output folder and
    metrics, shared read-only."""
    from tests.conftest import train_in_process

    out = tmp_path_factory.mktemp("plain")
    return out, run_metrics(train_in_process, data, out)[1]


# --- gradient checkpointing -------------------------------------------------------------------


def test_gradient_checkpointing_keeps_the_maths_and_saves_activations(
    train_cli, data, plain, tmp_path
):
    plain_out, plain = plain
    proc, checkpointed = run_metrics(
        train_cli, data, tmp_path / "checkpointed", "--gradient-checkpointing"
    )
    assert "lever     gradient checkpointing (non-reentrant" in proc.stdout
    assert "Memory (gradient-checkpointing)" in proc.stdout
    assert checkpointed["levers"] == ["gradient-checkpointing"] and plain["levers"] == []
    # Recomputing forward in backward (dropout replayed with the same RNG) changes no number.
    assert_identical(
        load_tensors(plain_out / "final"),
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


@pytest.mark.slow
def test_gradient_checkpointing_resumes_exactly(train_cli, data, tmp_path):
    options = ("--gradient-checkpointing", "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


def test_a_model_without_gradient_checkpointing_is_refused():
    import torch

    from effitrain.levers import enable_gradient_checkpointing

    with pytest.raises(EffitrainError, match="Linear does not support gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


# --- levers together --------------------------------------------------------------------------

ALL_LEVERS = (
    "--optim",
    "adafactor-hf",
    "--gradient-checkpointing",
    "--optimizer-in-backward",
    "--weights-dtype",
    "bf16",
    "--lora-rank",
    "4",
)


def test_all_levers_together_train_and_each_part_shrinks(train_cli, data, plain, tmp_path):
    plain = plain[1]
    proc, levered = run_metrics(train_cli, data, tmp_path / "all", *ALL_LEVERS)
    assert levered["levers"] == [
        "gradient-checkpointing",
        "optimizer-in-backward",
        "bf16-weights",
        "lora",
    ]
    for line in (
        "weights bf16",
        "gradient checkpointing",
        "optimizer step in backward",
        "LoRA r=4",
    ):
        assert f"lever     {line}" in proc.stdout
    assert (
        "Memory (gradient-checkpointing, optimizer-in-backward, bf16-weights, lora)" in proc.stdout
    )
    # The baseline is the model without adapters, trained whole in fp32 with AdamW: the same as
    # the plain run's measured parts.
    assert levered["baseline"]["parameter_bytes"] == plain["parameter_bytes"]
    assert levered["baseline"]["optimizer_state_bytes"] == plain["optimizer_state"]["bytes"]
    # bf16 base weights (plus fp32 adapters and head copies): well under the fp32 model.
    assert levered["parameter_bytes"] < 0.65 * plain["parameter_bytes"]
    assert levered["trainable_parameter_bytes"] < 0.2 * levered["parameter_bytes"]
    # Over bf16 base weights, every trained parameter (adapters, head) stays fp32.
    assert levered["trainable_parameter_bytes"] == 4 * levered["trainable_parameters"]
    assert levered["gradient_bytes"] < 0.1 * plain["gradient_bytes"]  # one head matrix at a time
    assert levered["optimizer_state"]["bytes"] < 0.05 * plain["optimizer_state"]["bytes"]
    assert levered["peak_tensor_bytes"] < plain["peak_tensor_bytes"]
    step = levered["step_memory"]
    assert step["peak_tensor_bytes"] == sum(step["at_peak"].values())


@pytest.mark.slow
def test_all_levers_together_resume_exactly(train_cli, data, tmp_path):
    options = (*ALL_LEVERS, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    compared = assert_identical(
        load_tensors(straight / "checkpoint-8"), load_tensors(resumed / "checkpoint-8")
    )
    assert compared > 20  # the adapters, the head and their optimizer state
    from safetensors.torch import load_file

    adapters = "final/adapter_model.safetensors"
    assert_identical(load_file(straight / adapters), load_file(resumed / adapters))


@pytest.mark.parametrize("kind", ["fsdp2", "deepspeed"])
def test_bf16_weights_under_sharding_are_refused(kind):
    from types import SimpleNamespace

    from effitrain.config import TrainConfig
    from effitrain.levers import check_launch

    state = SimpleNamespace(
        distributed_type="FSDP" if kind == "fsdp2" else "DEEPSPEED",
        num_processes=2,
        backend="gloo",
        fsdp_plugin=SimpleNamespace(fsdp_version=2),
        deepspeed_plugin=SimpleNamespace(zero_stage=2),
    )
    config = TrainConfig(weights_dtype="bf16").validate()
    with pytest.raises(EffitrainError, match="--weights-dtype bf16 is not supported under"):
        check_launch(config, state)
    check_launch(TrainConfig().validate(), state)  # fp32 weights: not this rule's business
