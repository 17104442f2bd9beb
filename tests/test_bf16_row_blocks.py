"""The bf16 Adafactor step block by block of rows (effitrain.optim.stochastic_rounding): the
same fp32 update as the whole-tensor step within fp32 rounding, a rounding that is deterministic
per seed and resumes exactly, and temporaries bounded by a block, not by the weight."""

from __future__ import annotations

import io

import pytest
import torch
from transformers.optimization import Adafactor as AdafactorHF

from effitrain.optim import fsdp2, stochastic_rounding
from effitrain.optim.bf16 import BF16_VARIANTS, ParamSeeds

HF_REGISTRY = {"relative_step": False, "scale_parameter": False, "warmup_init": False}
"""The registry's transformers Adafactor (the Trainer's optim="adafactor")."""
RULES = [
    pytest.param(torch.optim.Adafactor, fsdp2.Adafactor, {"lr": 1e-2}, id="torch"),
    pytest.param(
        torch.optim.Adafactor, fsdp2.Adafactor, {"lr": 1e-2, "weight_decay": 0.1}, id="torch-wd"
    ),
    pytest.param(
        torch.optim.Adafactor,
        fsdp2.Adafactor,
        {"lr": 1e-2, "maximize": True, "d": 2.0},
        id="torch-maximize-d",
    ),
    pytest.param(AdafactorHF, fsdp2.AdafactorHF, {"lr": 1e-3, **HF_REGISTRY}, id="hf"),
    pytest.param(
        AdafactorHF,
        fsdp2.AdafactorHF,
        {"lr": 1e-3, **HF_REGISTRY, "weight_decay": 0.1},
        id="hf-wd",
    ),
    pytest.param(
        AdafactorHF, fsdp2.AdafactorHF, {"lr": 1e-3, **HF_REGISTRY, "beta1": 0.9}, id="hf-beta1"
    ),
    pytest.param(
        AdafactorHF, fsdp2.AdafactorHF, {"lr": None, "beta1": 0.9}, id="hf-relative-step-beta1"
    ),
]
"""Both rules: the registry's options, with and without weight decay and beta1, and the
library's other paths (maximize and d; the relative step with parameter scaling)."""
SHAPES = [
    pytest.param((7,), 3, marks=pytest.mark.slow),
    ((9, 4), 4),
    pytest.param((5, 3, 2), 2, marks=pytest.mark.slow),
    pytest.param((3, 2, 4, 5), 2, marks=pytest.mark.slow),
]
"""Shapes and rows per block, every last block shorter: 1-D (elements), 2-D (the column factor
summed over blocks, in the fast tier), 3-D and 4-D (both factors split with the rows)."""


@pytest.mark.parametrize(("library", "ours", "options"), RULES)
@pytest.mark.parametrize(("shape", "rows"), SHAPES, ids=lambda case: str(case).replace(" ", ""))
def test_row_blocked_update_equals_the_whole_tensor_update(library, ours, options, shape, rows):
    """30 fp32 steps: the library's own step on the whole weight, and ours block by block
    (each block's fp32 result written back as it comes, as the bf16 step rounds it): weights and
    state stay equal within fp32 rounding."""
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(shape))
    blocked = torch.nn.Parameter(whole.detach().clone())
    reference, optimizer = library([whole], **options), ours([blocked], **options)

    def write(block_rows, block):
        blocked.data[block_rows] = block

    for _ in range(30):
        whole.grad = torch.randn(shape)
        blocked.grad = whole.grad.clone()
        reference.step()
        optimizer.row_blocked_update(optimizer.param_groups[0], blocked, rows, write)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    expected, got = reference.state[whole], optimizer.state[blocked]
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert type(got[key]) is type(value), key
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=key)


def _bf16_optimizer(name: str, params: list[torch.Tensor], seed: int = 0):
    """The bf16 variant the registry builds for ``--optim name`` (lr 1e-2)."""
    return BF16_VARIANTS[name].factory([{"params": params}], 1e-2, ParamSeeds(seed))


@pytest.mark.parametrize("name", ["adafactor", "adafactor-hf"])
def test_bf16_step_hands_the_rounding_the_whole_tensor_update(name, monkeypatch):
    """Over 20 steps of the bf16 variants, from the same bf16 weights each step (the rounding
    then draws differently): the fp32 values handed to the rounding, row-blocked, equal the
    whole-tensor step's within fp32 rounding; the blocks come in order, the last one shorter."""
    handed: list[torch.Tensor] = []
    rounding = stochastic_rounding.round_stochastic_

    def record(target, value, generator, scratch=None):
        handed.append(value.clone())
        rounding(target, value, generator, scratch)

    monkeypatch.setattr(stochastic_rounding, "round_stochastic_", record)
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(10, 6).bfloat16())
    blocked = torch.nn.Parameter(whole.detach().clone())
    optimizers = _bf16_optimizer(name, [whole]), _bf16_optimizer(name, [blocked])
    for _ in range(20):
        whole.grad = torch.randn(10, 6).bfloat16()
        blocked.grad = whole.grad.clone()
        optimizers[0].step()
        monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", 24)  # 4 rows
        optimizers[1].step()
        monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", 2**24)
        expected, *blocks = handed
        assert [len(block) for block in blocks] == [4, 4, 2]
        torch.testing.assert_close(torch.cat(blocks), expected, rtol=1e-6, atol=1e-7)
        handed.clear()
        whole.data.copy_(blocked.data)


@pytest.mark.parametrize("name", ["adafactor", "adafactor-hf"])
def test_row_blocked_rounding_is_deterministic_and_resumes_exactly(name, monkeypatch):
    """Weights several blocks tall (and a small one, stepped whole): the same seed rounds the
    same way, another seed differently, and 4 steps, a save (through torch.save, as a
    checkpoint), a fresh optimizer that loads it and 4 more steps end bit for bit where 8
    uninterrupted steps end, state included."""
    monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", 16)
    torch.manual_seed(0)
    start = [torch.randn(9, 5).bfloat16(), torch.randn(3, 2, 4).bfloat16(), torch.randn(4)]
    grads = [[torch.randn(p.shape).to(p.dtype) for p in start] for _ in range(8)]

    def train(params, optimizer, steps):
        for step_grads in steps:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            optimizer.step()

    def fresh(seed=0):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        return params, _bf16_optimizer(name, params, seed)

    straight, uninterrupted = fresh()
    train(straight, uninterrupted, grads)
    again, other_seed = fresh(), fresh(seed=1)
    train(*again, grads)
    train(*other_seed, grads)
    assert all(torch.equal(a, b) for a, b in zip(straight, again[0], strict=True))
    assert not torch.equal(straight[0], other_seed[0][0])

    first, optimizer = fresh()
    train(first, optimizer, grads[:4])
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    loaded = _bf16_optimizer(name, resumed)
    loaded.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    train(resumed, loaded, grads[4:])
    for p, q in zip(straight, resumed, strict=True):
        assert torch.equal(p, q)
        assert list(uninterrupted.state[p]) == list(loaded.state[q])
        for key, value in uninterrupted.state[p].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, loaded.state[q][key]), key
            else:
                assert value == loaded.state[q][key], key


@pytest.mark.parametrize("name", ["adafactor", "adafactor-hf"])
def test_the_steps_temporaries_are_one_blocks(name, monkeypatch):
    """One bf16 weight 16 blocks tall, its step measured by the run's own probe: updated whole,
    its fp32 temporaries are 3 to 4 copies of the weight; by blocks, as many of one block."""
    from effitrain.memory.step import StepMemoryProbe, available

    if not available():
        pytest.skip("needs torch's MemTracker")
    shape, block_elements = (256, 64), 1024  # 16 rows a block

    def temporaries(blocked: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Linear(shape[1], shape[0], bias=False).bfloat16()
        optimizer = _bf16_optimizer(name, list(model.parameters()))
        if blocked:
            monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", block_elements)
        for measured in (False, True):  # the first step makes the state
            with StepMemoryProbe(model, optimizer, torch.device("cpu")) as probe:
                if measured:
                    probe.start()
                model.weight.grad = torch.randn(shape).bfloat16()
                optimizer.step()
                memory = probe.stop() if measured else None
        assert memory is not None
        return memory.kind_peaks["optimizer_temporaries"]

    # Whole: the fp32 weight, its gradient and the update (transformers': and grad**2 + eps).
    assert temporaries(blocked=False) >= 3 * 4 * shape[0] * shape[1]
    # Blocks: as many copies of one block (and the blocks' copies of the factors).
    assert temporaries(blocked=True) <= 5 * 4 * block_elements


def test_blocks_are_the_fewest_that_fit_with_their_rows_evened_out(monkeypatch):
    rows_per_block = stochastic_rounding.rows_per_block
    assert stochastic_rounding.ROW_BLOCK_ELEMENTS == 2**27
    assert rows_per_block(torch.Size([14336, 4096])) is None  # Llama-3.1-8B's MLP: whole
    assert stochastic_rounding.BLOCK_ELEMENTS == 2**25
    assert rows_per_block(torch.Size([128256, 4096])) == 8016  # its output layer: 16 blocks
    assert rows_per_block(torch.Size([151936, 896])) == 30388  # Qwen2.5-0.5B's embedding: 5
    assert rows_per_block(torch.Size([151936, 1536])) == 21706  # a 1.5B's: 7 blocks
    monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", 12)
    assert rows_per_block(torch.Size([12])) is None
    assert rows_per_block(torch.Size([13])) == 7  # 7 + 6, not 12 + 1
    assert rows_per_block(torch.Size([10, 5])) == 2  # 2 rows fit: 5 blocks
    assert rows_per_block(torch.Size([4, 20])) == 1  # a row larger than a block: one a block
    assert rows_per_block(torch.Size([1, 20])) is None


@pytest.mark.slow
def test_a_run_in_row_blocks_resumes_exactly(train_cli, data, tmp_path, monkeypatch):
    """The tiny model with blocks of 8192 elements (every matrix but one in 2 to 4 blocks): a
    run stopped and resumed from its checkpoint ends bit for bit where the uninterrupted run
    ends."""
    from tests.test_resume import assert_same_end, straight_and_resumed

    monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", 8192)
    options = ("--weights-dtype", "bf16", "--optim", "adafactor", "--max-steps", "6")
    straight, resumed = straight_and_resumed(
        train_cli, data, tmp_path, 3, *options, "--save-every", "3"
    )
    assert_same_end(straight, resumed, 6)
