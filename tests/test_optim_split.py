"""Muon, GaLore, APOLLO (effitrain.optim.split): the hidden-matrix split, the combined optimizer,
state counted to the byte, exact resume, inspect-state, sharding and other refusals."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from effitrain import distributed
from effitrain.errors import EffitrainError
from effitrain.memory import ledger as memory
from effitrain.optim import build_optimizer, get_spec, param_groups
from effitrain.optim.split import hidden_matrices
from tests.checkpoint_helpers import assert_identical, load_tensors, train_args

SPLIT = ["muon", "galore", "apollo", "apollo-mini"]


def tiny():
    from effitrain.models import load_model, load_tokenizer

    torch.manual_seed(0)
    return load_model("tiny", ["a", "b"], load_tokenizer("tiny"))


def names(model, groups):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for g in groups for p in g["params"])


def one_step(model, optimizer, seed=0):
    torch.manual_seed(seed)
    x = torch.randint(0, 150, (4, 12))
    model(input_ids=x, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# --- the split ------------------------------------------------------------------------------


def test_tiny_preset_split_keeps_embeddings_head_and_1d_out_and_weight_decay():
    model = tiny()
    hidden, other = hidden_matrices(model, param_groups(model, 0.01))
    hidden_names = names(model, hidden)
    assert len(hidden_names) == 12  # q, k, v, out, lin1, lin2 in 2 layers
    assert all(".transformer.layer." in n and n.endswith(".weight") for n in hidden_names)
    other_names = names(model, other)
    for name in (
        "distilbert.embeddings.word_embeddings.weight",
        "distilbert.embeddings.position_embeddings.weight",
        "pre_classifier.weight",
        "classifier.weight",
        "classifier.bias",
    ):
        assert name in other_names
    assert len(hidden_names) + len(other_names) == len(list(model.parameters()))
    assert {g["weight_decay"] for g in hidden} == {0.01}
    assert [g["weight_decay"] for g in other] == [0.01, 0.0]  # 2-D embeddings/head, 1-D


@pytest.mark.parametrize(
    ("config_name", "kwargs", "excluded"),
    [
        ("BertConfig", {}, ["bert.pooler.dense.weight", "bert.embeddings.token_type_embeddings"]),
        ("MPNetConfig", {}, ["relative_attention_bias.weight", "classifier.dense.weight"]),
    ],
)
def test_bert_pooler_and_mpnet_relative_bias_are_not_hidden(config_name, kwargs, excluded):
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        **kwargs,
    )
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    hidden, _ = hidden_matrices(model, param_groups(model, 0.0))
    hidden_names = names(model, hidden)
    assert len(hidden_names) == 12  # q, k, v, attention output, intermediate, output × 2
    assert not any(x in n for n in hidden_names for x in excluded)
    assert not any("embeddings" in n for n in hidden_names)


def lora_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        tiny(),
        LoraConfig(
            task_type="SEQ_CLS",
            r=4,
            target_modules=["q_lin", "v_lin"],
            modules_to_save=["pre_classifier", "classifier"],
        ),
    )


def test_with_lora_the_hidden_matrices_are_the_adapters():
    model = lora_model()
    hidden, other = hidden_matrices(model, param_groups(model, 0.01))
    hidden_names = names(model, hidden)
    assert len(hidden_names) == 8 and all("lora_" in n for n in hidden_names)
    assert all("modules_to_save" in n for n in names(model, other))
    optimizer = build_optimizer(model, "muon", 1e-3, 0.01)
    one_step(model, optimizer)
    assert "Muon on 8 hidden matrices" in optimizer.split_description


@pytest.mark.parametrize("optim", ["galore", "apollo"])
def test_projections_refuse_lora(optim):
    with pytest.raises(EffitrainError, match="already low-rank adapters"):
        build_optimizer(lora_model(), optim, 1e-3, 0.01)


# --- the combined optimizer, the ledger ----------------------------------------------------


def independent_bytes(optimizer) -> tuple[int, int]:
    """(bytes, elements) from the saved state_dict, walked with the layout known per key:
    projection matrices must be rank × the shorter side (no hidden SVD factor kept alive)."""
    saved = optimizer.state_dict()
    shapes = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            shapes[index] = (tuple(p.shape), group.get("rank"))
            index += 1
    total = elements = 0
    for i, entry in saved["state"].items():
        shape, rank = shapes[i]
        for key, value in entry.items():
            if key == "projector":
                ortho = value["ortho_matrix"]
                assert ortho.numel() == rank * min(shape), (shape, tuple(ortho.shape))
                assert ortho.untyped_storage().nbytes() == ortho.numel() * 4
                scalars = [v for v in value.values() if isinstance(v, (int, float, bool))]
                total += ortho.numel() * 4 + 8 * len(scalars)
                elements += ortho.numel() + len(scalars)
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
                elements += value.numel()
            elif isinstance(value, (int, float)):
                total += 8
                elements += 1
    return total, elements


@pytest.mark.parametrize("optim", SPLIT)
def test_ledger_counts_every_byte_projectors_included(optim):
    model = tiny()
    optimizer = build_optimizer(model, optim, 1e-3, 0.01)
    one_step(model, optimizer)
    ledger = memory.optimizer_state_ledger(optimizer)
    assert (ledger.bytes, ledger.elements) == independent_bytes(optimizer)
    # The saved state (projectors as dicts) is counted the same as the live one.
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert memory.optimizer_state_ledger(saved).bytes == ledger.bytes
    if optim == "muon":
        # Muon: one fp32 momentum per hidden matrix (12, 4 B per element); AdamW for the rest.
        hidden = 2 * (4 * 128 * 128 + 2 * 128 * 256)
        assert ledger.by_key["momentum_buffer"].bytes == hidden * 4
        assert ledger.by_key["momentum_buffer"].tensors == 12
        assert ledger.by_key["exp_avg"].tensors == 28
    else:
        assert ledger.by_key["projector.ortho_matrix"].tensors == 12


def test_muon_looks_like_one_optimizer_to_the_scheduler_and_state_dict():
    from effitrain.optim import build_scheduler

    model = tiny()
    optimizer = build_optimizer(model, "muon", 1e-3, 0.01)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    scheduler = build_scheduler(optimizer, "linear", 10, 2)
    one_step(model, optimizer)
    scheduler.step()
    lrs = {g["lr"] for g in optimizer.param_groups}
    assert lrs == {muon.param_groups[0]["lr"]} == {adamw.param_groups[1]["lr"]} == {1e-3 / 2}
    saved = optimizer.state_dict()
    assert [len(g["params"]) for g in saved["param_groups"]] == [
        12,
        4,
        24,
    ]  # Muon; AdamW 2-D (embeddings, head), 1-D
    assert sorted(saved["state"]) == list(range(40))
    assert set(saved["state"][0]) == {"momentum_buffer"}
    assert set(saved["state"][12]) == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_scheduler_still_drives_the_inner_optimizers_after_load_state_dict():
    """Accelerate's prepare (and resume) calls load_state_dict; the lr the scheduler sets must
    still reach Muon and AdamW afterwards (it once did not: nothing trained)."""
    from effitrain.optim import build_scheduler

    model = tiny()
    optimizer = build_optimizer(model, "muon", 1e-3, 0.01)
    optimizer.load_state_dict(optimizer.state_dict())
    scheduler = build_scheduler(optimizer, "linear", 10, 2)
    scheduler.step()
    muon, adamw = optimizer.optimizers
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 1e-3 / 2
    assert all(
        a is b
        for a, b in zip(optimizer.param_groups, muon.param_groups + adamw.param_groups, strict=True)
    )
    before = [p.detach().clone() for p in model.parameters()]
    one_step(model, optimizer)
    assert all(
        not torch.equal(a, p)
        for a, p in zip(before, model.parameters(), strict=True)
        if p.ndim == 2
    )


@pytest.mark.parametrize("optim", SPLIT)
def test_state_dict_round_trip_continues_bit_exact(optim):
    model_a = tiny()
    opt_a = build_optimizer(model_a, optim, 1e-3, 0.01)
    one_step(model_a, opt_a, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model_b = tiny()
    model_b.load_state_dict(saved["model"])
    opt_b = build_optimizer(model_b, optim, 1e-3, 0.01)
    opt_b.load_state_dict(saved["opt"])
    for seed in (2, 3):
        one_step(model_a, opt_a, seed)
        one_step(model_b, opt_b, seed)
    assert_identical(model_a.state_dict(), model_b.state_dict())
    assert_identical(opt_a.state_dict(), opt_b.state_dict())


# --- through the CLI: exact resume, inspect-state, a demo that learns ------------------------


@pytest.mark.parametrize(
    "optim",
    [
        pytest.param("muon", marks=pytest.mark.slow),
        pytest.param("galore", marks=pytest.mark.slow),
        pytest.param("apollo", marks=pytest.mark.slow),
    ],
)
def test_resume_is_exact_and_inspect_state_names_it(train_cli, data, tmp_path, optim):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # update_proj_gap is 200: the projection is not refreshed within 8 steps, so the resumed
    # run must use the saved projection matrices.
    options = ("--optim", optim, "--max-steps", "8", "--save-every", "4")
    proc = train_cli(*train_args(data, straight, *options))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "split     " in proc.stdout and "hidden matrices" in proc.stdout
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-4", resumed / "checkpoint-4")
    proc = train_cli(*train_args(data, resumed, *options, "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_identical(
        load_tensors(straight / "checkpoint-8"), load_tensors(resumed / "checkpoint-8")
    )
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))

    proc = train_cli("inspect-state", str(straight / "checkpoint-8"), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["optimizer"]["name"] == optim
    raw = train_cli(
        "inspect-state", str(straight / "checkpoint-8" / "optimizer.bin"), "--json", "--top", "50"
    )
    assert raw.returncode == 0, raw.stdout + raw.stderr
    raw_report = json.loads(raw.stdout)
    expected = {
        "muon": "Muon + AdamW",
        "galore": "pytorch_optimizer.GaLore",
        "apollo": "APOLLOAdamW",
    }[optim]
    assert expected in raw_report["optimizer"]["class"]
    if optim != "muon":
        shapes = {tuple(p["shape"]) for p in raw_report["largest"] if p["shape"]}
        assert (128, 128) in shapes and (256, 128) in shapes and (128, 256) in shapes


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", SPLIT)
@pytest.mark.parametrize("sharding", ["fsdp1", "fsdp2", "deepspeed"])
def test_sharding_is_refused(optim, sharding):
    from tests.test_distributed import deepspeed, fsdp

    state = {"fsdp1": fsdp(1), "fsdp2": fsdp(2), "deepspeed": deepspeed(2)}[sharding]
    with pytest.raises(EffitrainError) as error:
        distributed.optimizer_notes(state, optim)
    message = str(error.value)
    assert "\n" not in message and f"--optim {optim} cannot run under" in message
    assert "whole 2-D hidden matrix" in message and "use DDP" in message


@pytest.mark.parametrize(
    ("optim", "package"), [("galore", "pytorch-optimizer"), ("apollo", "apollo-torch")]
)
def test_missing_package_gives_the_install_line(monkeypatch, optim, package):
    import importlib.util

    spec = get_spec(optim)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == spec.module else real(name, *a),
    )
    with pytest.raises(EffitrainError) as error:
        build_optimizer(tiny(), optim, 1e-3, 0.0)
    assert f"pip install 'effitrain[{optim}]'  ({package})" in str(error.value)


def test_in_backward_is_refused():
    import effitrain.levers as levers
    from effitrain.config import TrainConfig

    config = TrainConfig(optim="muon", optimizer_in_backward=True)
    with pytest.raises(EffitrainError, match="cannot combine with --optimizer-in-backward"):
        levers.check_options(config)  # with the options, before anything is built
    builder = levers.optimizer_builder(config)
    with pytest.raises(EffitrainError, match="built over the whole model, not one parameter"):
        build_optimizer(tiny(), "muon", 1e-3, 0.0, builder=builder)
