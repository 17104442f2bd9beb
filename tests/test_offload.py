"""The offload levers (``--activation-offload``, ``--optimizer-offload``): CUDA levers, tested
here on the CPU with CUDA's streams and pinned memory stood in for (``pretend_cuda``), so that
torchao's ``CPUOffloadOptimizer`` and trl's ``OffloadActivations`` run their own code: updates
equal the plain optimizer's, the state is counted where it lives, checkpoints round-trip, the
counted host bytes are what moved; and every combination that cannot work is refused in one
line. What only a GPU shows (the copies' overlap, the CUDA peaks) is in benchmarks/gpu.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest

from effitrain.build import checked_config
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error
from tests.test_loop import fresh_accelerate

__all__ = ["fresh_accelerate"]  # the autouse fixture, imported so it applies here too


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream:
    """A CUDA stream that does everything at once (the CPU has one stream)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, *args) -> _Event:
        return _Event()


@pytest.fixture
def pretend_cuda():
    """torchao and trl believe a CUDA device is there: streams that run in order, pinned
    allocations that are plain ones. Their tensors all stay on the CPU."""
    import torch
    import torchao.optim.cpu_offload as cpu_offload

    empty_like = torch.empty_like
    stream = _Stream()

    def unpinned(tensor, *args, pin_memory=False, **kwargs):
        return empty_like(tensor, *args, **kwargs)

    patches = [
        mock.patch.object(cpu_offload, "get_available_devices", lambda: ["cpu", "cuda"]),
        mock.patch.object(torch, "empty_like", unpinned),
        mock.patch.object(torch.Tensor, "record_stream", lambda tensor, stream: None),
    ]
    for module in (torch.cuda, torch.cpu):
        patches += [
            mock.patch.object(module, "Stream", _Stream),
            mock.patch.object(module, "stream", lambda s: contextlib.nullcontext()),
            mock.patch.object(module, "current_stream", lambda *a: stream),
        ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


@pytest.fixture
def pretend_accelerator(pretend_cuda):
    """trl asks torch which accelerator there is: the CPU, as if it were one (its streams are
    ``pretend_cuda``'s)."""
    import torch

    with (
        mock.patch.object(
            torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")
        ),
        mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True),
    ):
        yield


def small_model():
    """One weight torchao offloads (64 x 128 = 8192 elements), the rest below its 4096."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))


def batches(n: int = 3):
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 64, generator=generator) for _ in range(n)]


def optimizer_for(model, optim: str = "adamw", offload: str = "off"):
    """The registry's ``optim``, built as a run with ``--optimizer-offload OFFLOAD`` builds it."""
    import effitrain.levers as levers
    from effitrain.optim import build_optimizer

    builder = levers.optimizer_builder(TrainConfig(optim=optim, optimizer_offload=offload))
    assert (builder is None) == (offload == "off")
    return build_optimizer(model, optim, 1e-2, 0.01, builder=builder)


def train(model, optimizer, inputs, scheduler=None) -> None:
    for x in inputs:
        model(x).pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# --optimizer-offload: torchao's CPUOffloadOptimizer behind a normal optimizer
# --------------------------------------------------------------------------------------------


def test_offloaded_updates_equal_the_plain_optimizers_with_the_scheduler(pretend_cuda):
    import torch

    from effitrain.optim import build_scheduler

    results = []
    for offload in ("off", "state"):
        model = small_model()
        optimizer = optimizer_for(model, offload=offload)
        scheduler = build_scheduler(optimizer, "linear", 3, 1)  # the lr changes every step
        train(model, optimizer, batches(), scheduler)
        results.append([p.detach().clone() for p in model.parameters()])
    for plain, offloaded in zip(*results, strict=True):
        # torchao builds the host AdamW fused: the same update, summed in another order.
        torch.testing.assert_close(offloaded, plain, rtol=1e-5, atol=1e-6)


def test_the_state_is_counted_where_it_lives(pretend_cuda):
    from effitrain.memory import ledger
    from effitrain.optim.offload import offload_ledger

    plain_model, model = small_model(), small_model()
    plain, offloaded = optimizer_for(plain_model), optimizer_for(model, offload="state")
    train(plain_model, plain, batches(1))
    train(model, offloaded, batches(1))
    total = ledger.optimizer_state_ledger(offloaded)
    assert total.bytes == ledger.optimizer_state_ledger(plain).bytes
    assert total.params_with_state == 4
    where = offload_ledger(offloaded)
    big = 64 * 128
    assert where["host_state_bytes"] == 2 * 4 * big + 4  # exp_avg, exp_avg_sq, step
    assert where["device_state_bytes"] == total.bytes - where["host_state_bytes"]
    assert where["host_copy_bytes"] == 2 * 4 * big  # the weight's copy and its gradient's
    assert where["offloaded_parameters"] == 1
    assert offload_ledger(plain) == {}


def test_state_and_grads_frees_each_offloaded_gradient_in_backward(pretend_cuda):
    model = small_model()
    optimizer = optimizer_for(model, offload="state+grads")
    model(batches(1)[0]).sum().backward()
    big, *small = list(model.parameters())
    assert big.grad is None
    assert all(p.grad is not None for p in small)
    host = optimizer.offloaded.param_d2h_map[big]
    assert host.grad.abs().sum() > 0  # copied before it was freed


def test_checkpoint_round_trip_resumes_exactly(pretend_cuda, tmp_path):
    import torch

    from effitrain.memory import ledger

    first, second, third = batches()
    model = small_model()
    optimizer = optimizer_for(model, offload="state")
    train(model, optimizer, [first, second])
    saved = optimizer.state_dict()
    assert sorted(saved["state"]) == [0, 1, 2, 3]  # a normal optimizer's layout
    assert [len(g["params"]) for g in saved["param_groups"]] == [2, 2]
    torch.save({"model": model.state_dict(), "optimizer": saved}, tmp_path / "ckpt.pt")
    train(model, optimizer, [third])

    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_model = small_model()
    resumed_model.load_state_dict(loaded["model"])  # before the optimizer: torchao copies it
    resumed = optimizer_for(resumed_model, offload="state")
    resumed.load_state_dict(loaded["optimizer"])
    assert (
        ledger.optimizer_state_ledger(resumed).bytes
        == ledger.optimizer_state_ledger(optimizer).bytes
    )
    train(resumed_model, resumed, [third])
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "optim", ["adafactor", "adafactor-hf", "sgd", "adamw-8bit", "lion", "lion-8bit", "came"]
)
def test_per_parameter_optimizers_run_offloaded(pretend_cuda, optim):
    import torch

    from effitrain.memory import ledger

    results = []
    for offload in ("off", "state"):
        model = small_model()
        optimizer = optimizer_for(model, optim, offload=offload)
        train(model, optimizer, batches(2))
        results.append((model, ledger.optimizer_state_ledger(optimizer).bytes))
    (plain, plain_bytes), (offloaded, offloaded_bytes) = results
    assert offloaded_bytes == plain_bytes
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_accelerate_prepares_and_steps_it(pretend_cuda):
    import torch
    from accelerate import Accelerator

    from effitrain.optim import build_scheduler

    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = optimizer_for(model, offload="state")
    scheduler = build_scheduler(optimizer, "linear", 3, 1)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train(model, optimizer, batches(2), scheduler)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.optimizer.offloaded.optim_dict  # one host optimizer, stepped


# --------------------------------------------------------------------------------------------
# --activation-offload: trl's OffloadActivations, counted
# --------------------------------------------------------------------------------------------


def test_activation_offload_keeps_gradients_and_counts_what_moved(pretend_accelerator):
    import torch

    from effitrain.levers.activation_offload import HostBytes, offload_context

    model = small_model()
    x = batches(1)[0]
    model(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    counter = HostBytes()
    with offload_context(model, counter):
        model(x).pow(2).sum().backward()
    for a, p in zip(plain, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
    # Moved: the input (8 x 64) and the ReLU's output (8 x 128), fp32. Kept: the weights, the
    # tensors under 1 KiB (the logits, 8 x 2) and the ReLU output's second save (by the
    # second linear: the same storage).
    assert counter.peak == 4 * (8 * 64 + 8 * 128)
    assert counter.current == 0


def test_what_a_backward_recomputes_stays_on_the_device(pretend_accelerator):
    """The chunked loss recomputes each chunk's logits in backward, with grad on: they are used
    at once, so they are never offloaded (trl would copy them out and straight back)."""
    import torch

    from effitrain.levers.activation_offload import HostBytes, offload_context
    from effitrain.tasks.lm_loss import chunked_token_losses

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    head = torch.nn.Parameter(torch.randn(100, 32))
    x, labels = batches(1)[0], torch.randint(0, 100, (8,))
    counter = HostBytes()
    with offload_context(model, counter):
        losses = chunked_token_losses(model(x), head, None, labels)
        losses.sum().backward()
    # Moved in forward: the input (8 x 64) and the loss's hidden states (8 x 32), fp32. Not the
    # logits (8 x 100, 3,200 bytes) that backward recomputed.
    assert counter.peak == 4 * (8 * 64 + 8 * 32)
    assert counter.current == 0
    grads = [p.grad.clone() for p in (*model.parameters(), head)]
    for p in (*model.parameters(), head):
        p.grad = None
    chunked_token_losses(model(x), head, None, labels).sum().backward()
    for grad, p in zip(grads, (*model.parameters(), head), strict=True):
        assert torch.equal(grad, p.grad)


def estimate_on_cuda(options: dict) -> dict:
    """``effitrain estimate --device cuda``'s result (the offloads are CUDA levers), as the
    metrics JSON names its fields."""
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate

    return estimate(checked_config(None, options), Launch.described(1, "ddp", "cuda")).to_dict()


@pytest.mark.slow
def test_estimate_models_activation_offload_on_fake_tensors():
    options = {"task": "causal-lm", "model": "tiny-llama", "batch_size": 2, "max_length": 64}
    plain = estimate_on_cuda(options)
    offloaded = estimate_on_cuda({**options, "activation_offload": True})
    assert offloaded["levers"] == ["chunked-loss", "activation-offload"]  # the registry's order
    moved = offloaded["activation_offload_host_bytes"]
    assert moved > 0
    assert offloaded["activation_bytes"] < plain["activation_bytes"]
    assert offloaded["peak_tensor_bytes"] < plain["peak_tensor_bytes"]
    assert offloaded["parameter_bytes"] == plain["parameter_bytes"]
    # Its step's traffic (effitrain.cost): each offloaded tensor out, and back when used.
    assert plain["offload_bytes_per_step"] == 0
    assert moved <= offloaded["offload_bytes_per_step"] <= 2 * moved
    assert offloaded["flops_per_step"] == plain["flops_per_step"]


@pytest.mark.slow
def test_estimate_counts_offloaded_checkpoints_on_the_host_not_the_device(long_lm_model_dir):
    """--gradient-checkpointing --activation-offload for a GPU: at two lengths, the device's
    activations lose exactly the checkpoints (each layer's input: layers x tokens x hidden x 4
    bytes) and the host figure gains what moved (its checkpoint, read as views of the file, adds
    nothing: the step is the host's peak)."""
    hidden, layers = 96, 2  # the tiny-llama preset's
    for length in (256, 512):
        options = {
            "task": "causal-lm",
            "model": str(long_lm_model_dir),
            "batch_size": 1,
            "max_length": length,
            "gradient_checkpointing": True,
        }
        plain = estimate_on_cuda(options)
        offloaded = estimate_on_cuda({**options, "activation_offload": True})
        checkpoints = layers * length * hidden * 4
        assert plain["activation_bytes"] - offloaded["activation_bytes"] == checkpoints
        assert offloaded["peak_tensor_bytes"] <= plain["peak_tensor_bytes"]
        moved = offloaded["activation_offload_host_bytes"]
        # Beside the checkpoints, forward saves outside the layers: the final norm's input and
        # normalized states (fp32), its rsqrt, and the token ids (int64).
        assert moved == checkpoints + length * (2 * hidden * 4 + 4 + 8)
        assert offloaded["host_memory"]["step_bytes"] == moved
        assert offloaded["host_peak_bytes"] - plain["host_peak_bytes"] == moved


@pytest.mark.slow
def test_estimate_counts_optimizer_offload_state_on_the_host():
    options = {"task": "causal-lm", "model": "tiny-llama", "batch_size": 2, "max_length": 64}
    plain = estimate_on_cuda(options)
    result = estimate_on_cuda({**options, "optimizer_offload": "state+grads"})
    where = result["optimizer_offload"]
    assert (
        where["host_state_bytes"] + where["device_state_bytes"] == plain["optimizer_state"]["bytes"]
    )
    assert where["host_state_bytes"] > where["device_state_bytes"] > 0
    assert result["step_memory"]["at_peak"]["optimizer_state"] <= where["device_state_bytes"]
    assert result["gradient_bytes"] < plain["gradient_bytes"]
    host = where["host_state_bytes"] + where["host_copy_bytes"]
    assert result["host_memory"]["step_bytes"] == host  # the host figure's, not the device's
    assert result["peak_tensor_bytes"] < plain["peak_tensor_bytes"]
    # Per step: each offloaded gradient to the host, each parameter back (one micro-batch);
    # the host copies are one parameter and one gradient each.
    assert result["offload_bytes_per_step"] == where["host_copy_bytes"] > 0
    assert 4 * result["host_step_elements"] == where["host_copy_bytes"] // 2  # fp32


# --------------------------------------------------------------------------------------------
# Options, refusals, banner
# --------------------------------------------------------------------------------------------


def test_options_levers_and_banner():
    import effitrain.levers as levers

    config = checked_config(
        None,
        {
            "activation_offload": True,
            "optimizer_offload": "state+grads",
            "gradient_checkpointing": True,
        },
    )
    # The chunked loss is on by default (auto): in use only where the task is a causal LM's.
    assert [lever.name for lever in levers.active(config)] == [
        "gradient-checkpointing",
        "chunked-loss",
        "activation-offload",
        "optimizer-offload",
    ]
    assert levers.max_grad_norm(config) == 0
    lines = levers.banner_lines(config, None)
    assert any(line.startswith("offloaded checkpoints: each layer") for line in lines)
    assert any("CPUOffloadOptimizer" in line and "no clipping" in line for line in lines)


def test_yaml_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("activation-offload: true\noptimizer_offload: state\n")
    config = checked_config(path, {})
    assert config.activation_offload and config.optimizer_offload == "state"


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"optimizer_offload": "grads"}, "unknown --optimizer-offload 'grads'"),
        ({"optimizer_offload": "state", "optimizer_in_backward": True}, "choose one"),
        ({"optimizer_offload": "state", "max_grad_norm": 1.0}, "before clipping"),
        ({"optimizer_offload": "state", "mixed_precision": "fp16"}, "loss scaler"),
        ({"optimizer_offload": "state+grads", "grad_accum": 2}, "frees each gradient"),
        ({"optimizer_offload": "state", "optim": "muon"}, "built over the whole model"),
        ({"optimizer_offload": "state", "optim": "adamw-schedule-free"}, "parameter group"),
        ({"optimizer_offload": "state", "optim": "adamw-4bit"}, "lr as a tensor"),
    ],
)
def test_refused_combinations(options, fragment):
    with pytest.raises(EffitrainError, match=fragment.replace("(", r"\(")):
        checked_config(None, options)


def test_gradient_accumulation_is_allowed_with_state_only():
    checked_config(None, {"optimizer_offload": "state", "grad_accum": 4})


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"activation_offload": True}, "--activation-offload moves activations"),
        ({"optimizer_offload": "state"}, "--optimizer-offload moves the optimizer state"),
    ],
)
def test_refused_on_a_cpu_device(options, fragment):
    import effitrain.levers as levers
    from effitrain.distributed import Launch

    config = TrainConfig(**options)
    state = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    with (
        mock.patch(
            "effitrain.distributed.detect_sharding",
            return_value=SimpleNamespace(kind="single", num_processes=1),
        ),
        pytest.raises(EffitrainError, match=fragment) as error,
    ):
        levers.check_launch(config, Launch.of(state))
    assert "this run's device is the CPU" in str(error.value)


def test_optimizer_offload_refused_on_several_processes():
    import effitrain.levers as levers
    from effitrain.distributed import Launch

    config = TrainConfig(optimizer_offload="state")
    state = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    sharding = SimpleNamespace(kind="ddp", num_processes=2, description="2 processes (DDP)")
    with (
        mock.patch("effitrain.distributed.detect_sharding", return_value=sharding),
        pytest.raises(EffitrainError, match="before the processes average them"),
    ):
        levers.check_launch(config, Launch.of(state))


@pytest.mark.parametrize(
    ("flag", "what"),
    [(["--activation-offload"], "activations"), (["--optimizer-offload", "state"], "optimizer")],
)
def test_cli_refuses_offload_on_the_cpu_in_one_line(train_cli, flag, what):
    proc = train_cli("train", "--max-steps", "1", *flag)
    assert_clean_error(proc, f"{flag[0]} moves", what, "this run's device is the CPU")
