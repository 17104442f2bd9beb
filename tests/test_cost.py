"""A step's cost (``effitrain.cost``): the counter against PyTorch's ``FlopCounterMode``,
checkpointing's recompute told apart, the time model's direction, the GPU peaks for MFU. The
fake step against a real one, to the FLOP: ``tests/test_estimate.py``'s ``compare``."""

from __future__ import annotations

import pytest

from effitrain.cost import StepCost, modeled_step_seconds, peak_flops


def test_the_counter_counts_what_flop_counter_mode_counts_and_the_cpus_attention():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from effitrain.cost import StepCounter, extra_flop_formulas

    layer = torch.nn.Linear(16, 48)
    x = torch.randn(2, 2, 8, 16)  # batch, heads, tokens, head size: the CPU's fused kernel

    def step() -> None:
        q, k, v = layer(x).chunk(3, dim=-1)
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    with FlopCounterMode(display=False) as plain:
        step()
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as reference:
        step()
    with StepCounter() as counter:
        step()
    cost = counter.cost()
    assert cost.flops_per_step == reference.get_total_flops() > plain.get_total_flops()
    assert cost.recompute_flops == cost.half_precision_flops == 0
    assert cost.operator_calls > 0 and cost.elementwise_bytes > 0


def test_checkpointings_recompute_is_counted_apart():
    """The recompute is the FLOPs a checkpointed step adds, to the FLOP."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from effitrain.cost import StepCounter
    from effitrain.levers.gradient_checkpointing import _recompute_contexts

    block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(4, 32, requires_grad=True)

    def run(checkpointed: bool) -> StepCost:
        with StepCounter() as counter:
            if checkpointed:
                y = checkpoint(block, x, use_reentrant=False, context_fn=_recompute_contexts)
            else:
                y = block(x)
            y.sum().backward()
        return counter.cost()

    plain, checkpointed = run(False), run(True)
    assert plain.recompute_flops == 0
    # What the recompute runs (up to the last tensor backward needs: PyTorch's early stop).
    assert checkpointed.recompute_flops == checkpointed.flops_per_step - plain.flops_per_step > 0


def test_the_model_charges_flops_precision_bytes_and_offload():
    base = StepCost(
        flops_per_step=10**12,
        recompute_flops=0,
        offload_bytes_per_step=0,
        elementwise_bytes=10**9,
        operator_calls=1000,
    )
    recomputed = StepCost(**{**base.to_dict(), "flops_per_step": 4 * 10**12 // 3})
    half = StepCost(**{**base.to_dict(), "half_precision_flops": 10**12})
    offloaded = StepCost(**{**base.to_dict(), "offload_bytes_per_step": 10**10})
    for device in ("cpu", "cuda"):
        seconds = modeled_step_seconds(base, device)
        assert modeled_step_seconds(recomputed, device) > seconds
        assert modeled_step_seconds(half, device) < seconds
    assert modeled_step_seconds(offloaded, "cuda") > modeled_step_seconds(base, "cuda")


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10G", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("Tesla T4", None),
        ("cpu", None),
    ],
)
def test_bf16_peaks_by_device_name(name, tflops):
    assert peak_flops(name) == (tflops * 1e12 if tflops else None)


def test_mfu_leaves_the_recompute_out_and_needs_a_known_peak():
    from effitrain.cost import throughput

    cost = StepCost(flops_per_step=4 * 10**12, recompute_flops=10**12, offload_bytes_per_step=0)
    h100 = throughput(cost, 0.5, "NVIDIA H100 80GB HBM3")
    assert h100["achieved_tflops"] == pytest.approx(8.0)  # the recompute ran: it is work done
    assert h100["mfu"] == pytest.approx(3e12 / 0.5 / 989e12) and h100["peak_tflops"] == 989.0
    cpu = throughput(cost, 0.5, "cpu")
    assert cpu["mfu"] is None and cpu["achieved_tflops"] == pytest.approx(8.0)
    assert throughput(None, 0.5, "cpu")["flops_per_step"] is None


def test_bitsandbytes_4bit_matmul_is_counted():
    """QLoRA's forward runs bitsandbytes' own 4-bit matmul, which PyTorch's registry lacks."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    import torch

    from effitrain.cost import StepCounter

    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")
    x = torch.randn(3, 5, 64)
    with StepCounter() as counter:
        layer(x)
    assert counter.flops == 2 * 3 * 5 * 64 * 32
