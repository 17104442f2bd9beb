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

    from effitrain.levers import gradient_checkpointing

    with pytest.raises(EffitrainError, match="Linear does not support gradient checkpointing"):
        gradient_checkpointing.enable(torch.nn.Linear(2, 2))


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
    # In the registry's order, the order the levers act in (effitrain.levers.LEVERS).
    assert levered["levers"] == [
        "bf16-weights",
        "gradient-checkpointing",
        "lora",
        "optimizer-in-backward",
    ]
    for line in (
        "weights bf16",
        "gradient checkpointing",
        "optimizer step in backward",
        "LoRA r=4",
    ):
        assert f"lever     {line}" in proc.stdout
    assert (
        "Memory (bf16-weights, gradient-checkpointing, lora, optimizer-in-backward)" in proc.stdout
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
    from effitrain.distributed import Launch
    from effitrain.levers import check_launch

    state = SimpleNamespace(
        distributed_type="FSDP" if kind == "fsdp2" else "DEEPSPEED",
        num_processes=2,
        backend="gloo",
        fsdp_plugin=SimpleNamespace(fsdp_version=2),
        deepspeed_plugin=SimpleNamespace(zero_stage=2),
    )
    launch = Launch.of(state)
    config = TrainConfig(weights_dtype="bf16").validate()
    with pytest.raises(EffitrainError, match="--weights-dtype bf16 is not supported under"):
        check_launch(config, launch)
    check_launch(TrainConfig().validate(), launch)  # fp32 weights: not this rule's business


# --- the registry ------------------------------------------------------------------------------


def test_every_lever_is_a_spec_owning_its_own_config_fields():
    import dataclasses

    from effitrain.config import TrainConfig
    from effitrain.levers import LEVERS, Lever, lever_of

    config_fields = {field.name for field in dataclasses.fields(TrainConfig)}
    owners: dict[str, str] = {}
    for name, lever in LEVERS.items():
        assert isinstance(lever, Lever)
        assert lever.name == name and lever.name
        assert lever.fields, name
        for field in lever.fields:
            assert field in config_fields, (name, field)
            assert field not in owners, f"{field} is owned by {owners.get(field)} and {name}"
            owners[field] = name
            assert lever_of(field) is lever
        assert set(lever.save_only) <= set(lever.fields), name
    # Off by default, but for the chunked loss: --chunked-loss's default (unset, shown as
    # "auto") is on, for every task; a run that is not a causal LM's takes no chunked loss, and
    # its metrics do not list it (ChunkedLoss.in_use reads what the task's loss did).
    default = TrainConfig()
    assert {name for name, lever in LEVERS.items() if lever.is_on(default)} == {"chunked-loss"}
    assert not LEVERS["chunked-loss"].is_on(TrainConfig(chunked_loss="off"))


CUDA_ONLY = {"activation-offload", "optimizer-offload", "context-parallel"}
"""The levers that this CPU machine refuses (test_offload and test_context_parallel test their
refusal)."""

CAUSAL_LM = ("--task", "causal-lm", "--chunked-loss", "off")
"""The tiny-llama preset without its default lever, so that the lever tested is alone."""

ALONE = {
    "load-in-4bit": ((*CAUSAL_LM, "--load-in-4bit", "--lora-rank", "4"), ["load-in-4bit", "lora"]),
    "bf16-weights": (("--weights-dtype", "bf16"), ["bf16-weights"]),
    "gradient-checkpointing": (("--gradient-checkpointing",), ["gradient-checkpointing"]),
    "tiled-mlp": ((*CAUSAL_LM, "--tiled-mlp"), ["tiled-mlp"]),
    "tiled-norm": ((*CAUSAL_LM, "--tiled-norm"), ["tiled-norm"]),
    "lora": (("--lora-rank", "4"), ["lora"]),
    "lean-lora": (("--lora-rank", "4", "--lean-lora"), ["lora", "lean-lora"]),
    "chunked-loss": (("--task", "causal-lm", "--chunked-loss", "torch"), ["chunked-loss"]),
    "optimizer-in-backward": (("--optimizer-in-backward",), ["optimizer-in-backward"]),
    "reference": (
        ("--task", "preference", "--chunked-loss", "off", "--reference", "copy"),
        ["reference"],
    ),
}
"""Per lever: the options that turn it on, and the metrics' ``levers`` they give (QLoRA needs
LoRA under it)."""


def test_the_alone_table_covers_every_lever():
    from effitrain.levers import LEVERS

    assert set(ALONE) | CUDA_ONLY == set(LEVERS) and not set(ALONE) & CUDA_ONLY


@pytest.fixture(scope="module")
def small_data(data, tmp_path_factory):
    """The files a lever's run trains on instead of its task's demo (most of a 1-step run's
    time: 3,400 rows tokenized and 400 evaluated for classification), by ``--task``:
    classification's 24/8-row csvs, and 12 short documents for the causal LM. The preference
    run keeps its demo."""
    train, validation, _ = data
    text = tmp_path_factory.mktemp("small-lm") / "train.txt"
    document = " ".join(["the cat sat on a mat while dogs ran"] * 20)
    text.write_text("\n\n".join([document] * 12) + "\n")
    return {
        "classification": ("--train-file", str(train), "--validation-file", str(validation)),
        "causal-lm": ("--train-file", str(text)),
        "preference": (),
    }


def task_of(options: tuple[str, ...]) -> str:
    return options[options.index("--task") + 1] if "--task" in options else "classification"


@pytest.mark.slow  # ten 1-step runs: the levers in use are the built run's, one step names them
@pytest.mark.parametrize("lever", list(ALONE))
def test_each_lever_alone_is_named_in_the_metrics(train_cli, tmp_path, small_data, lever):
    options, expected = ALONE[lever]
    options = (*small_data[task_of(options)], *options)
    metrics = tmp_path / "m.json"
    proc = train_cli("train", "--max-steps", "1", "--metrics-json", str(metrics), *options)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(metrics.read_text())
    assert lever in result["levers"]
    assert result["levers"] == expected


@pytest.mark.slow  # with the test above
@pytest.mark.parametrize("options", [(), CAUSAL_LM])
def test_without_levers_none_is_named(train_cli, tmp_path, small_data, options):
    """The runs the table's are set against: the classification preset (whose default, still
    "on" chunked loss is not in use: see the registry's test) and the causal LM's without it."""
    options = (*small_data[task_of(options)], *options)
    metrics = tmp_path / "m.json"
    proc = train_cli("train", "--max-steps", "1", "--metrics-json", str(metrics), *options)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(metrics.read_text())["levers"] == []
