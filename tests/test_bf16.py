"""Pure-bf16 weights (--weights-dtype bf16): refusals, the Kahan-summation update, training,
saving, and bit-exact resume."""

from __future__ import annotations

import json

import pytest

from effitrain.build import check_config
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import load_tensors, train_args
from tests.conftest import assert_clean_error
from tests.test_resume import assert_same_end, straight_and_resumed


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (
            ("--optim", "lion"),
            (
                "--weights-dtype bf16 needs",
                "adamw, sgd, adafactor, adafactor-hf",
                "--optim lion: it has no bf16 variant",
                "use --weights-dtype fp32, or --lora-rank",
            ),
        ),
        (("--optim", "adamw-8bit"), ("--optim adamw-8bit", "bitsandbytes rounds")),
        (("--mixed-precision", "fp16"), ("--mixed-precision fp16", "drop --mixed-precision")),
        (("--weights-dtype", "fp16"), ("unknown --weights-dtype 'fp16'", "fp32, bf16")),
    ],
    ids=["lion", "adamw-8bit", "fp16-autocast", "unknown-dtype"],
)
def test_refused_before_anything_is_built(train_cli, tmp_path, options, fragments):
    proc = train_cli("train", "--weights-dtype", "bf16", *options, "--max-steps", "1")
    assert_clean_error(proc, *fragments)
    assert "effitrain ·" not in proc.stdout  # no banner: refused before building


def optimizer_spec(config: TrainConfig):
    """The optimizer spec a run with ``config`` builds: the registry's, with the bf16 variant."""
    import effitrain.levers as levers
    from effitrain.optim import get_spec

    return levers.optimizer_spec(get_spec(config.optim), config)


def test_lora_trains_fp32_adapters_so_any_optimizer_is_allowed():
    # The rule is about the trained parameters' dtype: LoRA adapters stay fp32.
    for optim in ("adamw-8bit", "lion"):
        check_config(TrainConfig(weights_dtype="bf16", optim=optim, lora_rank=8).validate())
        with pytest.raises(EffitrainError, match="needs an optimizer"):
            check_config(TrainConfig(weights_dtype="bf16", optim=optim).validate())
    # Nothing to round on fp32 adapters: the registry's Adafactor trains them.
    lora = TrainConfig(weights_dtype="bf16", optim="adafactor-hf", lora_rank=8)
    assert optimizer_spec(lora).class_path == "transformers.optimization.Adafactor"
    with pytest.raises(EffitrainError, match="fp16"):
        check_config(
            TrainConfig(weights_dtype="bf16", lora_rank=8, mixed_precision="fp16").validate()
        )


def test_missing_optimi_is_one_install_line(train_cli, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "optimi" else real(name, *a)
    )
    proc = train_cli("train", "--weights-dtype", "bf16", "--max-steps", "1")
    assert_clean_error(proc, "optimi.AdamW", "pip install 'effitrain[bf16]'")


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_variant_keeps_steps_that_bf16_rounding_would_lose(optim):
    """One bf16 weight at 1.0 and steps of about 1e-4 (below bf16's spacing of 2**-7 near 1):
    a plain optimizer rounds every step away, the bf16 variant accumulates them."""
    plain = _train_bf16_weights(optim, None, (1, 1))
    kahan = _train_bf16_weights(optim, TrainConfig(weights_dtype="bf16", optim=optim), (1, 1))
    assert plain.item() == 1.0  # every step rounded away
    # AdamW: 200 steps of lr (0.98); SGD with momentum 0.9: about 10x that (0.82).
    expected = (
        1 - 200 * 1e-4
        if optim == "adamw"
        else 1 - 1e-4 * sum((1 - 0.9 ** (k + 1)) / 0.1 for k in range(200))
    )
    assert abs(kahan.item() - expected) < 2**-7


def _train_bf16_weights(optim, config, shape, dtype=None):
    """200 steps of lr 1e-4 with gradient 1 on weights that start at 1.0 (bf16 unless
    ``dtype``), by the registry's optimizer (``config`` None) or ``config``'s bf16 variant."""
    import torch

    from effitrain.optim import build_optimizer

    model = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype or torch.bfloat16)
    torch.nn.init.ones_(model.weight)
    spec = optimizer_spec(config) if config else optim
    optimizer = build_optimizer(model, spec, 1e-4, 0.0)
    for _ in range(200):
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
    return model.weight.detach().float()


@pytest.mark.parametrize("optim", ["adafactor", "adafactor-hf"])
def test_stochastic_rounding_drifts_as_the_fp32_twin(optim):
    """Adafactor's steps of about 1e-4 (both rules: lr 1e-4, a unit update) on bf16 weights at
    1.0: round-to-nearest drops every one; stochastic rounding moves the weights as fp32 does,
    in expectation (the mean over 4096 weights: its noise is about 1e-4)."""
    import torch

    shape = (64, 64)
    twin = _train_bf16_weights(optim, None, shape, dtype=torch.float32).mean().item()
    plain = _train_bf16_weights(optim, None, shape)
    rounded = _train_bf16_weights(optim, TrainConfig(weights_dtype="bf16", optim=optim), shape)
    assert 0.975 < twin < 0.985  # 200 relative steps of 1e-4
    assert bool((plain == 1.0).all())
    assert abs(rounded.mean().item() - twin) < 1e-3
    assert rounded.std().item() > 0  # the weights round differently: the rounding is random


def test_rounding_is_pytorch_optimizers_with_our_generator():
    """The same 16 random bits give the same bf16 values as pytorch-optimizer's copy_stochastic
    (which draws them from the global RNG); values already in bf16 never move."""
    import torch

    from effitrain.optim.stochastic_rounding import round_stochastic_

    precision = pytest.importorskip("pytorch_optimizer.optimizer.utils.precision")
    value = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    ours, theirs = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.bfloat16)
    round_stochastic_(ours, value, torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    precision.copy_stochastic(theirs, value)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    exact = value.bfloat16()
    round_stochastic_(ours, exact.float(), torch.Generator().manual_seed(8))
    assert torch.equal(ours, exact)


def _train_bf16(train_cli, data, out, *options):
    """A run with bf16 weights; returns its process and its metrics JSON."""
    metrics = out.parent / "m.json"
    proc = train_cli(
        *train_args(data, out, "--weights-dtype", "bf16", *options), "--metrics-json", str(metrics)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(metrics.read_text())


def test_trains_saves_bf16_and_loads_back(train_cli, data, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "out"
    proc, m = _train_bf16(train_cli, data, out, "--max-steps", "3", "--save-every", "3")
    assert "weights bf16 (parameters, gradients, optimizer state), AdamW with Kahan" in proc.stdout
    assert "optimizer adamw (optimi.AdamW)" in proc.stdout
    saved = load_tensors(out / "checkpoint-3")
    assert {t.dtype for t in saved["model"].values()} == {torch.bfloat16}
    state = saved["optimizer.bin"]["state"]
    assert set(state[0]) == {"exp_avg", "exp_avg_sq", "kahan_comp"}
    assert {t.dtype for s in state.values() for t in s.values()} == {torch.bfloat16}
    assert any(bool(s["kahan_comp"].any()) for s in state.values())  # compensation in use

    assert m["optimizer_class"] == "optimi.AdamW"
    assert m["parameter_bytes"] == 2 * m["trainable_parameters"]
    if torch.cuda.is_available():  # the tracker counts CUDA's blocks: 512-byte multiples
        assert 0 <= m["gradient_bytes"] - m["parameter_bytes"] < 512 * len(state)
    else:
        assert m["gradient_bytes"] == m["parameter_bytes"]
    assert m["optimizer_state"]["bytes"] == 3 * m["parameter_bytes"]  # 2 moments + Kahan

    model = AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert model.dtype == torch.bfloat16
    logits = model(input_ids=torch.tensor([[1, 5, 7, 2]])).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.slow
def test_bf16_autocast_on_bf16_weights_is_allowed(train_cli, data, tmp_path):
    # Harmless: the matmuls already run in bf16; autocast adds fp32 outputs and fp32 ops.
    proc = train_cli(
        *train_args(data, tmp_path / "out", "--weights-dtype", "bf16", "--max-steps", "2"),
        "--mixed-precision",
        "bf16",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mixed precision bf16" in proc.stdout and "weights bf16" in proc.stdout


def test_nonfinite_guard_still_stops_bf16(train_cli, data, tmp_path):
    proc = train_cli(
        *train_args(data, tmp_path / "out", "--weights-dtype", "bf16", "--max-steps", "6"),
        "--lr",
        "1e8",
        "--max-grad-norm",
        "0",
    )
    assert_clean_error(proc, "non-finite", "stopped before the update")


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_resume_is_exact(train_cli, data, tmp_path, optim):
    """Kahan summation draws no random numbers: resumed bf16 weights, moments and compensation
    buffers are bit-identical to an uninterrupted run's (dropout's RNG comes back as always)."""
    options = ("--weights-dtype", "bf16", "--optim", optim, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)
    assert "kahan_comp" in load_tensors(resumed / "checkpoint-8")["optimizer.bin"]["state"][0]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("--optim", "adafactor"), marks=pytest.mark.slow),
        pytest.param(("--optim", "adafactor-hf"), marks=pytest.mark.slow),
        pytest.param(
            ("--optim", "adafactor-hf", "--optimizer-in-backward", "--gradient-checkpointing"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda options: " ".join(options),
)
def test_stochastic_rounding_resumes_exactly(train_cli, data, tmp_path, options):
    """The rounding generators' states are optimizer state: a resumed run draws the numbers the
    uninterrupted run drew, and its fp32 factors come back fp32 (not cast to the weights' bf16)."""
    import torch

    every = ("--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(
        train_cli, data, tmp_path, 4, "--weights-dtype", "bf16", *options, *every
    )
    assert_same_end(straight, resumed, 8)
    state = load_tensors(resumed / "checkpoint-8")["optimizer.bin"]["state"]
    assert {s["rounding_generator"].dtype for s in state.values()} == {torch.uint8}
    factors = {
        t.dtype
        for s in state.values()
        for key, t in s.items()
        if key not in ("step", "rounding_generator") and isinstance(t, torch.Tensor)
    }
    assert factors == {torch.float32}


@pytest.mark.parametrize("optim", ["adafactor", "adafactor-hf"])
def test_adafactor_trains_bf16_weights(train_cli, data, tmp_path, optim):
    import torch

    proc, m = _train_bf16(train_cli, data, tmp_path / "out", "--optim", optim, "--max-steps", "2")
    assert "weights bf16 (parameters, gradients; the factored state fp32)" in proc.stdout
    rule = "in fp32 per parameter (the largest by blocks of rows), stochastic rounding to bf16"
    assert rule in proc.stdout
    assert "+ stochastic rounding)" in proc.stdout  # the optimizer line's class
    assert m["optimizer_class"].endswith("Adafactor + stochastic rounding")
    assert m["parameter_bytes"] == 2 * m["trainable_parameters"]
    by_key = m["optimizer_state"]["by_key"]
    # One generator state per parameter, the CPU's Mersenne Twister (5056 bytes), counted.
    generator = by_key.pop("rounding_generator")
    assert generator["tensors"] == m["optimizer_state"]["params_with_state"]
    assert generator["bytes"] == generator["tensors"] * torch.Generator().get_state().numel()
    by_key.pop("step")  # a tensor in torch's Adafactor, a Python int in transformers'
    assert {dtype for usage in by_key.values() for dtype in usage["dtypes"]} == {"float32"}


@pytest.mark.slow
def test_resume_with_other_weights_dtype_is_refused(train_cli, data, tmp_path):
    out = tmp_path / "out"
    every = ("--save-every", "2")
    proc = train_cli(*train_args(data, out, *every, "--weights-dtype", "bf16", "--max-steps", "2"))
    assert proc.returncode == 0, proc.stderr
    proc = train_cli(*train_args(data, out, *every, "--max-steps", "4", "--resume", "latest"))
    assert_clean_error(proc, "optimi.AdamW", "torch.optim.AdamW", "--weights-dtype")
