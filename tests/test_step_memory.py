"""The per-step memory breakdown (effitrain.memory.step) on a plain torch model: its parts agree
with effitrain's own true-storage counts, add up to the peak, and the probe cleans up."""

from __future__ import annotations

import platform
import sys

import pytest

torch = pytest.importorskip("torch")

from effitrain.memory import ledger as memory  # noqa: E402
from effitrain.memory.step import StepMemoryProbe, available  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="needs torch's MemTracker")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64), torch.nn.ReLU()
    )


def step(model, optimizer, micro_batches=1, probe=None):
    for i in range(micro_batches):
        if probe is not None and i:
            probe.next_micro_batch()
        model(torch.randn(32, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_parts_match_the_true_storage_counts_and_add_up():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    step(model, optimizer)  # the state exists from here on
    with StepMemoryProbe(model, optimizer, torch.device("cpu")) as probe:
        probe.start()
        step(model, optimizer)
        measured = probe.stop()
    assert measured is not None
    at_peak, peaks = measured.at_peak, measured.kind_peaks
    assert measured.peak_tensor_bytes == sum(at_peak.values())
    assert at_peak["parameters"] == memory.parameter_bytes(model)
    assert at_peak["optimizer_state"] == memory.optimizer_state_ledger(optimizer).bytes
    assert peaks["gradients"] == memory.parameter_bytes(model)  # one gradient per weight
    # What forward keeps for backward: at least the input and the two ReLUs' outputs (which are
    # also the next layers' inputs), 32 rows each, fp32.
    assert peaks["activations"] >= 4 * 32 * (64 + 256 + 64)
    # AdamW's foreach step works on whole lists of tensors: its temporaries are not its state.
    assert peaks["optimizer_temporaries"] > 0
    assert measured.cuda_max_allocated is None


def test_gradient_accumulation_is_one_measured_step():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    step(model, optimizer)
    with StepMemoryProbe(model, optimizer, torch.device("cpu")) as probe:
        probe.start()
        step(model, optimizer, micro_batches=3, probe=probe)
        measured = probe.stop()
    # While the second micro-batch's gradients are added in, both they and the sums exist.
    assert measured is not None
    assert measured.kind_peaks["gradients"] > memory.parameter_bytes(model)
    assert measured.peak_tensor_bytes == sum(measured.at_peak.values())


def test_an_error_mid_step_leaves_no_tracker_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = StepMemoryProbe(model, optimizer, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="boom"), probe:
        probe.start()
        assert probe.running and _get_current_dispatch_mode() is not None
        raise RuntimeError("boom")
    assert not probe.running and _get_current_dispatch_mode() is None
    step(model, optimizer)  # training goes on untracked


def test_no_memory_breakdown_skips_the_measured_step(train_cli, tmp_path):
    """--no-memory-breakdown: no tracked step (it costs time and peak RSS), and the table says
    why the breakdown is missing; the rest of the report is unchanged."""
    import json

    out = tmp_path / "m.json"
    proc = train_cli(
        "train", "--max-steps", "3", "--no-memory-breakdown", "--metrics-json", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(out.read_text())
    assert metrics["step_memory"] == {} and metrics["activation_bytes"] is None
    assert metrics["config"]["memory_breakdown"] is False
    assert metrics["optimizer_state"]["bytes"] > 0 and metrics["peak_memory_bytes"] > 0
    assert "not measured (--no-memory-breakdown" in " ".join(proc.stdout.split())


def test_the_heap_is_trimmed_once_before_the_tracked_step_on_cpu(monkeypatch):
    """On CPU, start() hands the heap's free pages back before the tracker enters (the tracker's
    bookkeeping then fits in what the step held anyway), and nothing else calls it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from effitrain.memory import step as step_memory

    calls = []
    monkeypatch.setattr(
        step_memory, "return_freed_heap", lambda: calls.append(_get_current_dispatch_mode())
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    step(model, optimizer)
    with StepMemoryProbe(model, optimizer, torch.device("cpu")) as probe:
        probe.start()
        assert calls == [None]  # once, before the tracker (a dispatch mode) was active
        step(model, optimizer)
        probe.stop()
    assert calls == [None]


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
    reason="malloc_trim is glibc's",
)
def test_return_freed_heap_gives_pages_back_to_the_os():
    from effitrain.memory.step import return_freed_heap

    def rss_mib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    # 2,000 blocks of 64 KiB (under glibc's mmap threshold: they come from the heap), touched;
    # free all but the last, which keeps the heap from shrinking on its own.
    blocks = [bytearray(64 * 1024) for _ in range(2000)]
    keep = blocks[-1]
    del blocks
    before = rss_mib()
    return_freed_heap()
    assert before - rss_mib() > 60, "about 125 MiB of freed heap should go back"
    del keep


def test_extra_modules_and_tensors_are_counted_and_a_second_forward_is_taken():
    """What a lever holds through the step besides the model and the optimizer (DPO's frozen
    reference copy, its table of log-probs) is counted; the model called a second time in one
    micro-batch (the reference with adapters off) is no error."""
    import copy

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    frozen = copy.deepcopy(model).requires_grad_(False).to(torch.bfloat16)
    table = torch.zeros(100, 2)
    step(model, optimizer)
    with StepMemoryProbe(model, optimizer, torch.device("cpu"), extra=[frozen, table]) as probe:
        probe.start()
        inputs = torch.randn(32, 64)
        loss = model(inputs).square().mean()
        with torch.no_grad():
            reference = model(inputs).mean() + frozen(inputs.bfloat16()).float().mean()
        (loss + reference).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured = probe.stop()
    assert measured is not None
    at_peak = measured.at_peak
    assert at_peak["parameters"] == memory.parameter_bytes(model) + memory.parameter_bytes(frozen)
    assert at_peak["other"] == table.numel() * 4
    assert measured.peak_tensor_bytes == sum(at_peak.values())
