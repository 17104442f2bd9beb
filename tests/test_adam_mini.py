"""--optim adam-mini: the authors' Adam-mini over DistilBERT/BERT names, counted to the byte."""

from __future__ import annotations

import json

import pytest

from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import train_args

pytest.importorskip("adam_mini")

LAYOUT = {  # DistilBERT parameter name ending -> Adam-mini block (written out by hand)
    "word_embeddings.weight": "row",
    "position_embeddings.weight": "row",
    "q_lin.weight": "head",
    "k_lin.weight": "head",
    "v_lin.weight": "row",
    "out_lin.weight": "row",
    "lin1.weight": "row",
    "lin2.weight": "row",
    "pre_classifier.weight": "row",
    "classifier.weight": "row",
}


def tiny_distilbert():
    import torch

    from effitrain.models import load_model, load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer("tiny")
    return load_model("tiny", ["a", "b", "c"], tokenizer), len(tokenizer)


def stepped(model, vocab: int, steps: int = 2, weight_decay: float = 0.01):
    import torch

    from effitrain.optim import build_optimizer

    optimizer = build_optimizer(model, "adam-mini", 1e-3, weight_decay)
    for _ in range(steps):
        ids = torch.randint(5, vocab, (4, 16))
        model(input_ids=ids, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_state_is_counted_to_the_byte_from_the_block_layout():
    from effitrain.memory.ledger import optimizer_state_ledger

    model, vocab = tiny_distilbert()
    heads, dim = model.config.n_heads, model.config.dim
    optimizer = stepped(model, vocab)
    expected_elements = expected_bytes = 0
    for name, param in model.named_parameters():
        kind = next((k for end, k in LAYOUT.items() if name.endswith(end)), None)
        if kind is None:  # biases and LayerNorm weights: Adam, m and v in full, a step
            assert param.ndim == 1, name
            second, scalars = param.numel(), 1
        elif kind == "head":  # one value per attention head, plus step and head count
            second, scalars = heads, 2
            assert param.numel() == heads * dim * dim // heads
        else:  # one value per output row (neuron, token, class), plus step and row count
            second, scalars = param.shape[0], 2
        expected_elements += param.numel() + second + scalars
        expected_bytes += 4 * (param.numel() + second) + 8 * scalars
    ledger = optimizer_state_ledger(optimizer)
    assert (ledger.elements, ledger.bytes) == (expected_elements, expected_bytes)
    # The same count from the optimizer's own state_dict (what a checkpoint holds).
    assert optimizer_state_ledger(optimizer.state_dict()).bytes == expected_bytes
    # A q/k weight keeps m as (heads, head size) and one vmean per head; the big 2-D embedding
    # (well over 4096 elements) one vmean per token row.
    state = {
        name: optimizer.state[param] for name, param in model.named_parameters() if param.ndim > 1
    }
    q = state["distilbert.transformer.layer.0.attention.q_lin.weight"]
    assert tuple(q["m"].shape) == (heads, dim * dim // heads) and q["vmean"].numel() == heads
    emb = state["distilbert.embeddings.word_embeddings.weight"]
    assert emb["m"].numel() > 4096 and emb["vmean"].numel() == vocab
    # About half of AdamW's 8 bytes per parameter.
    params = sum(p.numel() for p in model.parameters())
    assert 4.0 < ledger.bytes / params < 4.2


@pytest.mark.parametrize("family", ["distilbert", "bert", "mpnet"])
def test_every_matrix_gets_a_head_or_row_block(family):
    """DistilBERT's, BERT's (MiniLM's) and MPNet's names are all recognised: no whole-tensor
    fallback (MPNet's attention.attn.q/k/v/o once fell through to one value per matrix)."""
    import transformers

    from effitrain.optim.adam_mini import ELEMENTWISE, PER_HEAD, PER_ROW, block_kind

    if family == "distilbert":
        model, vocab = tiny_distilbert()
    else:
        prefix = {"bert": "Bert", "mpnet": "MPNet"}[family]
        config = getattr(transformers, f"{prefix}Config")(
            vocab_size=200,
            hidden_size=48,
            num_hidden_layers=1,
            num_attention_heads=12,
            intermediate_size=96,
            num_labels=3,
        )
        model = getattr(transformers, f"{prefix}ForSequenceClassification")(config)
        vocab = 200
    optimizer = stepped(model, vocab, steps=1)
    kinds = {g["name"]: block_kind(optimizer, g["name"]) for g in optimizer.param_groups}
    params = dict(model.named_parameters())
    assert all(kinds[n.lower()] == ELEMENTWISE for n, p in params.items() if p.ndim == 1)
    matrices = {n: kinds[n.lower()] for n, p in params.items() if p.ndim > 1}
    # MPNet's relative-position table (buckets x heads) is named "…bias": Adam, elementwise.
    assert matrices.pop("mpnet.encoder.relative_attention_bias.weight", ELEMENTWISE) == ELEMENTWISE
    assert set(matrices.values()) == {PER_HEAD, PER_ROW}
    heads = [n for n, kind in matrices.items() if kind == PER_HEAD]
    assert heads and all(
        any(part in n for part in ("query", "key", "q_lin", "k_lin", "attn.q", "attn.k"))
        for n in heads
    )
    layers = getattr(model.config, "n_layers", None) or model.config.num_hidden_layers
    assert len(heads) == 2 * layers  # query and key of every layer


def test_weight_decay_follows_effitrains_groups():
    model, _ = tiny_distilbert()
    optimizer = stepped(model, 100, steps=0, weight_decay=0.05)
    for group in optimizer.param_groups:
        (param,) = group["params"]
        assert group["weight_decay"] == (0.05 if param.ndim >= 2 else 0.0), group["name"]


def test_dims_come_from_the_config_or_a_one_line_refusal():
    import torch
    from transformers import BertConfig

    from effitrain.optim.adam_mini import model_dims

    model, _ = tiny_distilbert()
    assert model_dims(model) == (model.config.dim, model.config.n_heads, model.config.n_heads)
    bert = torch.nn.Linear(2, 2)
    bert.config = BertConfig(hidden_size=48, num_attention_heads=6)
    assert model_dims(bert) == (48, 6, 6)
    with pytest.raises(EffitrainError) as error:
        model_dims(torch.nn.Linear(2, 2))
    assert "\n" not in str(error.value)
    assert "hidden size and attention heads" in str(error.value)


def test_lora_adapters_are_refused():
    import torch
    from transformers import BertConfig

    from effitrain.optim import build_optimizer

    model = torch.nn.Module()
    model.config = BertConfig(hidden_size=8, num_attention_heads=2)
    model.lora_A = torch.nn.Linear(8, 2)
    with pytest.raises(EffitrainError, match="not LoRA adapters; with --lora-rank use"):
        build_optimizer(model, "adam-mini", 1e-3, 0.0)


def test_a_1d_parameter_on_a_row_branch_is_refused_not_crashed():
    import torch
    from transformers import BertConfig

    from effitrain.optim import build_optimizer

    model = torch.nn.Module()
    model.config = BertConfig(hidden_size=8, num_attention_heads=2)
    model.mlp_scale = torch.nn.Parameter(torch.ones(8))  # "mlp": a per-row name, but 1-D
    with pytest.raises(EffitrainError, match="1-D parameter 'mlp_scale'"):
        build_optimizer(model, "adam-mini", 1e-3, 0.0)


def test_missing_package_is_one_install_line(monkeypatch):
    from effitrain.optim import OPTIMIZERS, build_optimizer

    monkeypatch.setattr(type(OPTIMIZERS["adam-mini"]), "is_available", lambda self: False)
    model, _ = tiny_distilbert()
    with pytest.raises(EffitrainError) as error:
        build_optimizer(model, "adam-mini", 1e-3, 0.0)
    assert str(error.value).endswith("pip install 'effitrain[mini]'  (adam-mini)")


def test_optimizer_in_backward_is_refused():
    from effitrain.build import checked_config

    with pytest.raises(EffitrainError, match="adam-mini cannot combine with --optimizer-in-back"):
        checked_config(overrides={"optim": "adam-mini", "optimizer_in_backward": True})


@pytest.mark.slow
def test_run_and_inspect_state_name_its_blocks(train_cli, data, tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.json"
    args = train_args(data, out, "--optim", "adam-mini", "--max-steps", "3", "--save-every", "3")
    proc = train_cli(*args, "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(metrics.read_text())
    assert result["optimizer_state"]["by_key"].keys() >= {"m", "vmean", "v", "head_per_gpu"}

    proc = train_cli("inspect-state", str(out / "checkpoint-3"), "--json", "--top", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["optimizer"]["class"] == "adam_mini.Adam_mini"
    assert report["optimizer_state"] == result["optimizer_state"]
    rows = {p["parameter"]: p for p in report["largest"]}
    emb = rows["distilbert.embeddings.word_embeddings.weight"]
    assert emb["second_moment"] == f"per row ({emb['shape'][0]:,} values)"
    q = rows["distilbert.transformer.layer.0.attention.q_lin.weight"]
    assert q["second_moment"].startswith("per head") and q["elements"] == 128 * 128
    bias = rows["distilbert.transformer.layer.0.attention.q_lin.bias"]
    assert bias["second_moment"] == "full" and bias["shape"] == [128]
    assert report["params_without_shape"] == 0
