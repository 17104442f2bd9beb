"""``--tiled-norm`` and ``--lean-lora``: what they recompute gives the numbers of the run without
them (peft's own, to the bit, for the adapters), alone and with the other levers; they keep less
(the estimate says how much, and equals a run to the byte); their refusals are one line."""

from __future__ import annotations

import pytest

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error
from tests.test_tiled_mlp import _assert_same, _batch, _model, _step

LONG = 200
"""Positions of the tiled norm's batches: past tiny-llama's hidden size (96), so 3 tiles."""


def _equal(got, expected) -> None:
    """Loss and every gradient equal to the bit."""
    import torch

    assert torch.equal(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        assert torch.equal(got[1][name], grad), name


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"gradient_checkpointing": True},
        {"lora_rank": 4, "lora_dropout": 0.0},
        {"tiled_mlp": True, "gradient_checkpointing": True},
    ],
    ids=["alone", "checkpointing", "lora", "tiled-mlp-checkpointing"],
)
def test_tiled_norm_equals_untiled(options):
    """Three tiles of 200 positions: the loss and the input's gradients exact; a trained
    norm's weight gradient (full fine-tuning) is a sum over tiles, within fp32's rounding."""
    batch = _batch(LONG, rows=1)
    untiled = _step(TrainConfig(**options), batch)
    _assert_same(_step(TrainConfig(**options, tiled_norm=True), batch), untiled)


def test_tiled_norm_under_autocast():
    batch = _batch(LONG, rows=1)
    untiled = _step(TrainConfig(), batch, autocast=True)
    _assert_same(_step(TrainConfig(tiled_norm=True), batch, autocast=True), untiled, scaled=True)


@pytest.mark.parametrize(
    ("options", "autocast"),
    [
        ({"lora_dropout": 0.0}, False),
        ({"lora_dropout": 0.5}, False),
        ({"lora_dropout": 0.5, "gradient_checkpointing": True}, False),
        ({"lora_dropout": 0.5, "tiled_mlp": True, "mlp_tiles": 3}, False),
        ({"lora_dropout": 0.5, "weights_dtype": "bf16"}, False),
        ({"lora_dropout": 0.5}, True),
    ],
    ids=["no-dropout", "dropout", "checkpointing", "tiled-mlp", "bf16-weights", "autocast"],
)
def test_lean_lora_is_peft_to_the_bit(options, autocast):
    """The cast, the dropout (the same masks: the random state replayed) and the projection
    are peft's operations in peft's order: the loss and every adapter's gradient are equal."""
    batch = _batch()
    plain = _step(TrainConfig(lora_rank=4, **options), batch, autocast=autocast)
    lean = _step(TrainConfig(lora_rank=4, lean_lora=True, **options), batch, autocast=autocast)
    _equal(lean, plain)


def test_each_gradient_is_accumulated_once():
    """Under checkpointing (each Function's forward runs twice), every adapter's and norm's
    gradient reaches it once per backward: DDP's reducer hooks count on it."""
    import effitrain.levers as levers

    config = TrainConfig(lora_rank=4, lean_lora=True, tiled_norm=True, gradient_checkpointing=True)
    model = levers.apply_to_model(_model(), config)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    accumulated = {id(p): 0 for p in trained}
    for p in trained:
        p.register_post_accumulate_grad_hook(
            lambda p: accumulated.__setitem__(id(p), 1 + accumulated[id(p)])
        )
    model(**_batch(LONG, rows=1)).loss.backward()
    assert set(accumulated.values()) == {1}


def test_lean_lora_keeps_peft_s_state_dict_and_copies():
    """The adapters' names and values are peft's (saving and loading them is unchanged), and
    a deep copy (DPO's reference) runs its own adapters."""
    import copy

    import torch

    import effitrain.levers as levers

    plain = levers.apply_to_model(_model(), TrainConfig(lora_rank=4))
    lean = levers.apply_to_model(_model(), TrainConfig(lora_rank=4, lean_lora=True))
    assert plain.state_dict().keys() == lean.state_dict().keys()
    copied = copy.deepcopy(lean)
    with torch.no_grad():  # the copy's A zero, its B not: its adapters add nothing
        for name, p in copied.named_parameters():
            if "lora_" in name:
                p.fill_(0.0 if "lora_A" in name else 1.0)
    x = torch.randint(3, 200, (1, 8))
    copied.eval()
    with torch.no_grad(), copied.disable_adapter():
        base = copied(input_ids=x).logits
    with torch.no_grad():
        assert torch.equal(copied(input_ids=x).logits, base)


def test_a_tiled_norm_copy_runs_its_own_weight():
    import copy

    import torch

    from effitrain.levers.tiled_norm import norm_modules, tile_norms

    model = _model()
    tile_norms(model)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        norm_modules(copied)[0].weight.zero_()
    x = torch.randn(1, 10, 96)
    assert norm_modules(copied)[0](x).abs().max() == 0
    assert norm_modules(model)[0](x).abs().max() > 0


def _fp32_copies(config: TrainConfig) -> int:
    """How many fp32 tensors of a position's width (96 hidden, 288 intermediate) autograd
    keeps for backward in one forward of tiny-llama in bf16 over 200 positions (adapters in
    fp32): the norms' upcasts, the adapters' cast and dropped-out inputs. Each storage once."""
    import torch

    import effitrain.levers as levers

    model = levers.apply_to_model(_model(config.weights_dtype), config)
    model.train()
    kept: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**_batch(LONG, rows=1))
    wide = {LONG * 96, LONG * 288}
    return sum(t.dtype == torch.float32 and t.numel() in wide for t in kept.values())


def test_each_keeps_less():
    """The norms' fp32 copies go with --tiled-norm, the adapters' with --lean-lora (with
    dropout on, peft keeps two a layer: the cast input and the dropped-out one), all with both."""
    assert _fp32_copies(TrainConfig(weights_dtype="bf16")) == 5  # 2 norms a layer, the last
    assert _fp32_copies(TrainConfig(weights_dtype="bf16", tiled_norm=True)) == 0
    lora = {"weights_dtype": "bf16", "lora_rank": 8, "lora_dropout": 0.1}
    assert _fp32_copies(TrainConfig(**lora)) > 5 + 2 * 7
    # The norms' but the first's: under LoRA the embeddings are frozen, so the first layer's
    # input needs no gradient and its norm keeps nothing.
    assert _fp32_copies(TrainConfig(**lora, lean_lora=True)) == 4
    assert _fp32_copies(TrainConfig(**lora, lean_lora=True, tiled_norm=True)) == 0


@pytest.mark.slow  # two runs and an estimate: about 12 s
def test_estimate_equals_a_run_with_both(train_cli, tmp_path):
    from tests.test_estimate import compare

    args = [
        "--task", "causal-lm", "--max-length", "128", "--batch-size", "2",
        "--lora-rank", "4", "--tiled-norm", "--lean-lora", "--gradient-checkpointing",
    ]  # fmt: skip
    estimated, measured = compare(train_cli, tmp_path, args)
    assert {"tiled-norm", "lean-lora"} <= set(measured["levers"])
    assert estimated["levers"] == measured["levers"]
    assert estimated["peak_tensor_bytes"] == measured["peak_tensor_bytes"]
    assert estimated["activation_bytes"] == measured["activation_bytes"]


def test_sharded_launches_are_refused():
    from effitrain.distributed import Launch
    from effitrain.levers import check_launch

    options = {"task": "causal-lm", "model": "tiny-llama", "lora_rank": 4}
    for lever in ("tiled_norm", "lean_lora"):
        config = TrainConfig(**options, **{lever: True})
        check_launch(config, Launch.described(2, "ddp", "cpu"))
        flag = "--" + lever.replace("_", "-")
        with pytest.raises(EffitrainError, match=f"{flag} is not supported under FSDP2"):
            check_launch(config, Launch.described(2, "fsdp", "cpu"))


def test_models_without_what_they_change_are_refused():
    import torch

    from effitrain.levers.lean_lora import lean
    from effitrain.levers.tiled_norm import tile_norms

    with pytest.raises(EffitrainError, match="--tiled-norm: Sequential has no RMSNorm"):
        tile_norms(torch.nn.Sequential(torch.nn.LayerNorm(4)))
    with pytest.raises(EffitrainError, match="no plain LoRA Linear layer"):
        lean(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--task", "causal-lm", "--lean-lora"], "--lean-lora needs --lora-rank R"),
        (["--tiled-norm"], "--tiled-norm needs --task causal-lm or preference"),
    ],
)
def test_bad_options_are_one_line(train_cli, args, fragment):
    assert_clean_error(train_cli("train", "--max-steps", "1", *args), fragment)
