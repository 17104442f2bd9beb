"""``--tiled-mlp``: the tiled MLP is exact (loss and every gradient equal to the untiled run's)
at several tile counts, with checkpointing, LoRA, bf16 weights and the chunked loss; each
parameter's gradient is accumulated once per step (under DDP too, where the run reports the
lever: a run of tests/test_distributed.py's shared launch); the estimate follows a tiled run;
the options' refusals are one line."""

from __future__ import annotations

import pytest

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error


def _model(weights_dtype: str = "fp32"):
    """tiny-llama (2 layers, hidden 96, intermediate 288), the same weights at every call."""
    import torch

    from effitrain.models import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    model = load_causal_lm("tiny-llama", load_tokenizer("tiny-llama"))
    return model.to(torch.bfloat16) if weights_dtype == "bf16" else model


def _batch(length: int = 50, rows: int = 2):
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (rows, length), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _step(config: TrainConfig, batch: dict, chunked: bool = False, autocast: bool = False):
    """One forward and backward of tiny-llama with ``config``'s levers (``autocast``: the
    forward under bf16 autocast): the loss and every trained parameter's gradient, by name."""
    import contextlib

    import torch

    import effitrain.levers as levers
    from effitrain.tasks.lm_loss import Choice, LMLoss, labelled_tokens

    model = levers.apply_to_model(_model(config.weights_dtype), config)
    model.train()
    torch.manual_seed(2)  # LoRA's dropout, where it is on, draws the same masks
    cast = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast:
        if chunked:
            loss = LMLoss(Choice("torch"), model)(model, batch) / labelled_tokens(batch)
        else:
            loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return loss.detach(), grads


def _assert_same(tiled, untiled, scaled: bool = False) -> None:
    """Loss and gradients equal within assert_close's tolerances for their dtype (``scaled``:
    the absolute one a rounding of the tensor's largest element, for sums of bf16 tiles)."""
    import torch

    torch.testing.assert_close(tiled[0], untiled[0])
    assert tiled[1].keys() == untiled[1].keys()
    for name, grad in untiled[1].items():
        atol = {"atol": 2**-8 * grad.abs().max().item(), "rtol": 1.6e-2} if scaled else {}
        torch.testing.assert_close(tiled[1][name], grad, **atol, msg=name)


@pytest.mark.parametrize("tiles", [None, 1, 3, 7, 50])
def test_tiled_equals_untiled(tiles):
    """50 positions in 1, 3 (17+17+16), 7 or 50 tiles, or auto (ceil(50 / 96) = 1)."""
    batch = _batch()
    untiled = _step(TrainConfig(), batch)
    _assert_same(_step(TrainConfig(tiled_mlp=True, mlp_tiles=tiles), batch), untiled)


@pytest.mark.parametrize(
    ("options", "chunked"),
    [
        ({"gradient_checkpointing": True}, False),
        ({"lora_rank": 4, "lora_dropout": 0.0}, False),
        ({"lora_rank": 4, "lora_dropout": 0.0, "gradient_checkpointing": True}, False),
        ({}, True),
    ],
    ids=["checkpointing", "lora", "lora-checkpointing", "chunked-loss"],
)
def test_tiled_equals_untiled_with_levers(options, chunked):
    batch = _batch()
    untiled = _step(TrainConfig(**options), batch, chunked)
    tiled = _step(TrainConfig(**options, tiled_mlp=True, mlp_tiles=3), batch, chunked)
    _assert_same(tiled, untiled)


def test_tiled_equals_untiled_in_bf16():
    """bf16 weights: the loss within bf16's tolerance, a weight's gradient within a rounding
    of its largest element (it is a sum of the tiles' gradients, each rounded to bf16, where
    the untiled matmul rounds once: elements near 0 differ by more than their own rtol)."""
    batch = _batch()
    untiled = _step(TrainConfig(weights_dtype="bf16"), batch)
    tiled = _step(TrainConfig(weights_dtype="bf16", tiled_mlp=True, mlp_tiles=3), batch)
    _assert_same(tiled, untiled, scaled=True)


def test_tiled_equals_untiled_under_autocast():
    """--mixed-precision bf16: the recompute in backward runs under the forward's autocast
    (outside it, it would compute in fp32 and differ by more than bf16's rounding)."""
    batch = _batch()
    untiled = _step(TrainConfig(), batch, autocast=True)
    tiled = _step(TrainConfig(tiled_mlp=True, mlp_tiles=3), batch, autocast=True)
    _assert_same(tiled, untiled, scaled=True)


def test_dropout_replays_in_backward_and_gradients_accumulate_once():
    """With LoRA's dropout on, backward recomputes each tile with the masks its forward drew
    (the gradients equal a plain run of the MLP tile by tile from the same seed), and each
    trained parameter's gradient reaches it once per backward (DDP's reducer hooks count)."""
    import torch

    import effitrain.levers as levers
    from effitrain.levers.tiled_mlp import mlp_modules
    from effitrain.levers.tiles import spans as _spans

    config = TrainConfig(lora_rank=4, lora_dropout=0.5, tiled_mlp=True, mlp_tiles=3)
    model = levers.apply_to_model(_model(), config)
    model.train()
    mlp = mlp_modules(model)[0]
    trained = [p for p in mlp.parameters() if p.requires_grad]
    accumulated = {id(p): 0 for p in trained}
    for p in trained:
        p.register_post_accumulate_grad_hook(
            lambda p: accumulated.__setitem__(id(p), 1 + accumulated[id(p)])
        )
    x = torch.randn(2, 10, 96, requires_grad=True)
    torch.manual_seed(3)
    mlp(x).square().sum().backward()
    tiled = [x.grad, *(p.grad for p in trained)]
    assert set(accumulated.values()) == {1}

    x.grad = None
    for p in trained:
        p.grad = None
    original = type(mlp).forward
    torch.manual_seed(3)
    parts = [original(mlp, x.narrow(1, start, width)) for start, width in _spans(10, 3)]
    torch.cat(parts, dim=1).square().sum().backward()
    for got, expected in zip(tiled, [x.grad, *(p.grad for p in trained)], strict=True):
        torch.testing.assert_close(got, expected)


def test_a_deep_copy_runs_its_own_weights():
    """DPO's reference copy is a deep copy of the model: its tiled MLPs run the copy's
    weights, not the original's."""
    import copy

    import torch

    from effitrain.levers.tiled_mlp import mlp_modules, tile

    model = _model()
    tile(model, 3)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        mlp_modules(copied)[0].down_proj.weight.zero_()
    x = torch.randn(1, 10, 96)
    assert mlp_modules(copied)[0](x).abs().max() == 0
    assert mlp_modules(model)[0](x).abs().max() > 0


def test_tile_counts():
    from effitrain.levers.tiles import spans as _spans
    from effitrain.levers.tiles import tile_count

    assert tile_count(16384, 4096, None) == 4  # ALST's choice: ceil(length / hidden)
    assert tile_count(16385, 4096, None) == 5
    assert tile_count(100, 4096, None) == 1
    assert tile_count(5, 96, 8) == 5  # at most one a position
    assert _spans(10, 3) == [(0, 2), (2, 4), (6, 4)]  # the first takes what is left
    assert _spans(330_752, 81)[:2] == [(0, 4032), (4032, 4084)]
    assert _spans(5, 4) == [(0, 2), (2, 1), (3, 1), (4, 1)]  # none left: within one


def test_sharded_launches_are_refused():
    from effitrain.distributed import Launch
    from effitrain.levers import check_launch

    config = TrainConfig(task="causal-lm", model="tiny-llama", tiled_mlp=True)
    check_launch(config, Launch.described(2, "ddp", "cpu"))
    for strategy, name in (("fsdp", "FSDP2"), ("zero2", "DeepSpeed ZeRO-2")):
        with pytest.raises(EffitrainError, match=f"--tiled-mlp is not supported under {name}"):
            check_launch(config, Launch.described(2, strategy, "cpu"))


def test_a_model_without_an_mlp_is_refused():
    import torch

    from effitrain.levers.tiled_mlp import tile

    with pytest.raises(EffitrainError, match="no decoder-layer MLP"):
        tile(torch.nn.Sequential(torch.nn.Linear(4, 4)), None)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--task", "causal-lm", "--tiled-mlp", "--mlp-tiles", "0"],
            "--mlp-tiles must be at least 1",
        ),
        (["--task", "causal-lm", "--tiled-mlp", "--mlp-tiles", "many"], "--mlp-tiles"),
        (["--task", "causal-lm", "--mlp-tiles", "4"], "--mlp-tiles needs --tiled-mlp"),
        (["--tiled-mlp"], "--tiled-mlp needs --task causal-lm or preference"),
    ],
)
def test_bad_options_are_one_line(train_cli, args, fragment):
    assert_clean_error(train_cli("train", "--max-steps", "1", *args), fragment)


@pytest.mark.slow
@pytest.mark.parametrize(
    "checkpointing", [[], ["--gradient-checkpointing"]], ids=["", "checkpointing"]
)
def test_estimate_equals_a_tiled_run(train_cli, tmp_path, checkpointing):
    """The estimate runs the tiled Function on fake tensors: FLOPs (the recompute's apart),
    gradients, activations and the peak equal the run's to the byte (as the chunked loss's
    test compares the same shape without the lever, tests/test_lm_loss.py)."""
    from tests.test_estimate import compare

    args = [
        "--task", "causal-lm", "--max-length", "64", "--batch-size", "4",
        "--tiled-mlp", "--mlp-tiles", "4", *checkpointing,
    ]  # fmt: skip
    estimated, measured = compare(train_cli, tmp_path, args)
    assert estimated["levers"] == measured["levers"]
    assert "tiled-mlp" in measured["levers"]
    assert estimated["peak_tensor_bytes"] == measured["peak_tensor_bytes"]
    assert estimated["activation_bytes"] == measured["activation_bytes"]
    assert measured["recompute_flops"] > 0


@pytest.mark.parametrize(
    ("length", "tiles", "options"),
    [
        # Two estimates each (about 2 s): the fast tier keeps the smallest case, whose estimate
        # equals every tile's; that fewer tiles run than there are shows with 9 or 7 tiles.
        pytest.param(50, 9, {}, marks=pytest.mark.slow),  # 2 positions, then 6 x 8
        (9, 4, {}),  # none left to the first: 3 positions, then 2 x 3
        pytest.param(
            290,
            7,
            {"lora_rank": 4, "gradient_checkpointing": True, "tiled_norm": True, "lean_lora": True},
            marks=pytest.mark.slow,
        ),  # 38, then 42 x 6; the norms' 4 tiles 71, then 73 x 3
    ],
)
def test_the_estimate_runs_one_tile_of_each_kind_and_counts_them_all(
    monkeypatch, length, tiles, options
):
    """On fake tensors one tile of each kind runs (tiles.runs), counted for all of its kind:
    the estimate (peak and its parts, every kind's peak, FLOPs, bytes, operator calls) equals
    the one that runs every tile; with LoRA, the norms' tiles, the adapters' (1 tile) inside
    the MLP's."""
    import effitrain.levers.tiles as tiles_module
    from effitrain.estimation import estimate

    config = TrainConfig(
        task="causal-lm", model="tiny-llama", max_length=length, batch_size=1, tiled_mlp=True,
        mlp_tiles=tiles, **options,
    )  # fmt: skip
    counted = []  # (positions, the tiles run)
    runs = tiles_module.runs

    def counting(hidden_states, tiles, settled):
        counted.append((hidden_states.shape[1], runs(hidden_states, tiles, settled)))
        return counted[-1][1]

    monkeypatch.setattr(tiles_module, "runs", counting)
    shortcut = estimate(config).to_dict()
    for positions, found in counted:  # every position once, counted
        assert sum(width * times for _, width, times in found) == positions
    assert max(len(found) for _, found in counted) <= 4  # of 9 or 7: one tile of each kind
    for settled in ("SETTLED_FORWARD", "SETTLED_BACKWARD"):  # every tile a kind of its own
        monkeypatch.setattr(tiles_module, settled, length)
    assert estimate(config).to_dict() == shortcut
