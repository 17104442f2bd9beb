"""``--context-parallel N`` (effitrain.levers.context_parallel): its refusals in one line, the
estimate's per-rank figure; on two CPU processes over gloo, the parts that run there (the batch
cut to each rank's share and the token-mean loss and gradient across the ranks) are checked in
test_fsdp2_optim.py's two-process launch (test_two_cp_ranks_on_gloo).

PyTorch's ring attention does not run on the CPU (torch 2.13: SDPA's CPU kernel has no sharding
rule), so no test trains end to end; ``python -m benchmarks.gpu`` does, on two GPUs.
"""

from __future__ import annotations

import pytest

from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error

CP = ["--context-parallel", "2", "--no-packing", "--max-length", "64"]


def _config(**overrides):
    from effitrain.build import checked_config

    return checked_config(None, {"model": "tiny-llama", "packing": False, **overrides})


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"context_parallel": 0}, "--context-parallel must be 1 or more (got 0)"),
        ({"context_parallel": 2, "packing": None}, "needs --no-packing: ring attention takes no"),
        ({"context_parallel": 2, "packing": True}, "needs --no-packing"),
        ({"context_parallel": 4, "max_length": 100}, "--max-length divisible by 8 (each rank"),
        (
            {"context_parallel": 2, "task": "preference", "packing": None},
            "--context-parallel needs --task causal-lm",
        ),
    ],
)
def test_options_refused(overrides, fragment):
    with pytest.raises(EffitrainError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _config(**overrides)


@pytest.mark.parametrize(
    ("launch", "fragment"),
    [
        ((2, "fsdp", "cpu"), "needs CUDA: PyTorch's ring attention runs only CUDA's attention"),
        ((2, "ddp", "cuda"), "needs FSDP2 (an accelerate config with distributed_type: FSDP"),
        ((2, "zero3", "cuda"), "this run is DeepSpeed ZeRO-3 over 2 processes"),
        ((3, "fsdp", "cuda"), "--context-parallel 2 must divide the number of processes (3)"),
        ((1, "fsdp", "cuda"), "needs FSDP2"),
    ],
)
def test_launches_refused(launch, fragment):
    import effitrain.levers as levers
    from effitrain.distributed import Launch

    with pytest.raises(EffitrainError) as refused:
        levers.check_launch(_config(context_parallel=2), Launch.described(*launch))
    assert fragment in str(refused.value)
    assert "\n" not in str(refused.value)


def test_accelerate_config_cp_size(monkeypatch):
    """An accelerate config's ``parallelism_config_cp_size`` turns it on; another value than
    --context-parallel's is refused."""
    from effitrain.levers import context_parallel

    monkeypatch.setenv(context_parallel.ENVIRONMENT, "2")
    assert context_parallel.size(_config()) == 2
    with pytest.raises(EffitrainError, match="but the accelerate config's cp_size is 2"):
        _config(context_parallel=4)


def test_parallelism_config_of_a_launch(monkeypatch):
    """Four FSDP2 processes on CUDA with --context-parallel 2: two CP ranks in each of two
    data-parallel shards, as Accelerate's ParallelismConfig."""
    import torch

    from effitrain.levers import context_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    parallelism = context_parallel.parallelism_config(_config(context_parallel=2))
    assert (parallelism.dp_replicate_size, parallelism.dp_shard_size) == (1, 2)
    assert parallelism.cp_size == 2 and parallelism.cp_enabled
    assert context_parallel.parallelism_config(_config()) is None


def test_train_refuses_one_process_in_one_line(train_cli):
    """One process (no FSDP2, no CUDA here) is refused before Accelerate starts."""
    assert_clean_error(
        train_cli("train", "--model", "tiny-llama", *CP, "--max-steps", "1"),
        "--context-parallel 2 needs CUDA",
    )


@pytest.mark.parametrize(
    ("supports", "implementation", "fragment"),
    [
        (False, "sdpa", "cannot take it: ring attention is full causal attention"),
        (True, "eager", "needs PyTorch's SDPA attention (ring attention takes its place)"),
    ],
)
def test_models_refused(supports, implementation, fragment):
    from types import SimpleNamespace

    from effitrain.levers.context_parallel import ContextParallel

    config = SimpleNamespace(_attn_implementation=implementation)
    model = SimpleNamespace(supports_context_parallel=supports, config=config)
    with pytest.raises(EffitrainError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ContextParallel().apply_to_model(model, _config(context_parallel=2), None)


def test_left_padding_refused():
    from types import SimpleNamespace

    from effitrain.levers.context_parallel import ContextParallel

    run = SimpleNamespace(config=_config(context_parallel=2), tokenizer=SimpleNamespace())
    run.tokenizer.padding_side = "left"
    with pytest.raises(EffitrainError, match="rows must be padded on the right"):
        ContextParallel().after_prepare(run)


# --- the estimate ---------------------------------------------------------------------------------


@pytest.mark.slow  # two estimates: about 5 s
def test_estimate_per_rank_is_one_rank_share():
    """CP 2 at L holds the activations of one process at L/2 (the fake step runs on the rank's
    share, not a division), the same FSDP2 shards of the model over the two ranks, and a peak
    at least as high (ring attention's gathered keys and values)."""
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate

    launch = Launch.described(2, "fsdp", "cuda")
    split = estimate(_config(context_parallel=2, max_length=128, batch_size=1), launch)
    half = estimate(_config(max_length=64, batch_size=1), launch)
    assert split.settings.max_length == 128
    ours, theirs = split.per_device, half.per_device
    assert ours is not None and theirs is not None
    assert ours.activation_bytes == theirs.activation_bytes
    for kind in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert getattr(ours, kind) == getattr(theirs, kind)
    assert ours.peak_tensor_bytes >= theirs.peak_tensor_bytes
    assert any("--context-parallel 2" in note for note in split.notes)


def test_gathered_keys_and_values_are_in_the_peak():
    """Around an attention, the other ranks' keys and values are held while it runs."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from effitrain.levers.context_parallel import GatheredKV

    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.empty.memory_format:
                sizes.append(tuple(args[0]))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with GatheredKV(4), Allocations():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    assert sizes.count((1, 2, 24, 4)) == 4  # keys and values, in forward and in backward
    assert F.scaled_dot_product_attention is not None
    expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    torch.testing.assert_close(out.detach(), expected)


# --- the loss -------------------------------------------------------------------------------------


def test_shift_labels_are_taken_as_shifted():
    """A batch with ``shift_labels`` (a CP rank's, shifted before the cut) gives the loss of
    the same batch with its ``labels``."""
    import torch

    from effitrain.tasks.lm_loss import Choice, LMLoss, shifted_labels

    model = torch.nn.Module()
    model.config = None
    ids = torch.randint(0, 11, (2, 6))
    embed, head = torch.nn.Embedding(11, 5), torch.nn.Linear(5, 11)

    def forward(input_ids, **_):
        return type("Out", (), {"logits": head(embed(input_ids))})()

    loss = LMLoss(Choice("off"), model)
    plain = loss(forward, {"input_ids": ids, "labels": ids})
    shifted = loss(forward, {"input_ids": ids, "labels": ids, "shift_labels": shifted_labels(ids)})
    torch.testing.assert_close(plain, shifted)


def test_step_scale_counts_a_cp_group_tokens_once():
    """Two CP ranks read the same batch: the step's labelled tokens are those of the batch."""
    from types import SimpleNamespace

    import torch

    from effitrain.tasks.lm_loss import labelled_tokens, step_scale

    batch = {"labels": torch.tensor([[1, 2, 3, -100, 5, 6, 7, 8]])}
    tokens = int(labelled_tokens(batch))
    accelerator = SimpleNamespace(
        num_processes=2,
        gradient_accumulation_steps=1,
        reduce=lambda t, _: t * 2,  # the other rank's count: the same batch's
        parallelism_config=SimpleNamespace(cp_enabled=True, cp_size=2),
    )
    assert float(step_scale([batch], accelerator)) == pytest.approx(2 / tokens)
