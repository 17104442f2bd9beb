"""torchao's low-bit AdamW (adamw-8bit-ao, adamw-4bit, adamw-fp8): state counted to the byte,
checkpoints, inspect-state, refusals.

torchao compiles its update (inductor) once per parameter shape, seconds each on a CPU. The
unit tests run the same update uncompiled (the ``uncompiled`` fixture); the runs through the CLI
(slow) trace it whole as torchao compiles it, on the tiny preset's shapes, but run the graph
without inductor's kernels (conftest's ``traced_not_inductor``), and count their checkpoints'
state to the byte.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import assert_identical, load_tensors, train_args
from tests.conftest import OFFLINE, assert_clean_error

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

NAMES = {"adamw-8bit-ao": "AdamW8bit", "adamw-4bit": "AdamW4bit", "adamw-fp8": "AdamWFp8"}

# Each quantized state tensor, read from torchao 0.18's subclass_*.py (not from the objects):
# (bytes per element of its codes, elements per fp32 scale = block size, fp32 qmap entries).
LAYOUT = {
    "AdamW8bit": (1.0, 256, 256),  # uint8 codes, one per element; 256-entry dynamic map
    "AdamW4bit": (0.5, 128, 16),  # two 4-bit codes per uint8; 16-entry map
    "AdamWFp8": (1.0, 256, 0),  # float8_e4m3fn codes; no map
}


class Shapes(torch.nn.Module):
    """One parameter on each side of torchao's rule (adam.py ``_new_buffer``): quantized when
    it has >= 4096 elements AND a multiple of the block size, else plain fp32 state."""

    SHAPES = {
        "at_threshold": (64, 64),  # 4096: quantized
        "large": (128, 96),  # 12288: quantized
        "below": (4095,),  # < 4096: fp32
        "not_divisible": (50, 100),  # 5000 >= 4096 but 5000 % 128, % 256 != 0: fp32
        "bias": (3,),
    }

    def __init__(self):
        super().__init__()
        for name, shape in self.SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(shape)))

    def forward(self):
        return sum((p * p).sum() for p in self.parameters())


def quantized(numel: int, block: int) -> bool:
    return numel >= 4096 and numel % block == 0


def expected_state(class_name: str, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(bytes, elements) of the state after a step, from the parameters' shapes and the
    layout above: per parameter a 0-d fp32 step, and exp_avg + exp_avg_sq each either
    codes + per-block scales + qmap, or one fp32 per element."""
    code_bytes, block, qmap = LAYOUT[class_name]
    nbytes = elements = 0
    for shape in shapes:
        nbytes, elements = nbytes + 4, elements + 1  # step
        n = math.prod(shape)
        for _moment in range(2):
            if quantized(n, block):
                code_elements = int(n * code_bytes)  # uint8 / fp8 storage elements
                nbytes += code_elements + (n // block) * 4 + qmap * 4
                elements += code_elements + n // block + qmap
            else:
                nbytes, elements = nbytes + 4 * n, elements + n
    return nbytes, elements


def shapes_of(model: torch.nn.Module) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in model.parameters()]


def stepped(class_name: str, steps: int = 1):
    from effitrain.optim.low_bit import build

    torch.manual_seed(0)
    model = Shapes()
    optimizer = build(class_name, [{"params": list(model.parameters())}], 1e-3)
    for _ in range(steps):
        model().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("class_name", list(LAYOUT))
def test_ledger_counts_fresh_state_without_compiling(class_name):
    # The state as torchao allocates it on the first step (its own ``_new_buffer``, which
    # holds the quantize-or-not rule), without the compiled update: fast, same bytes.
    from effitrain.memory.ledger import optimizer_state_ledger
    from effitrain.optim.low_bit import build

    model = Shapes()
    optimizer = build(class_name, [{"params": list(model.parameters())}], 1e-3)
    for p in model.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": optimizer._new_buffer(p, True),
            "exp_avg_sq": optimizer._new_buffer(p, False),
        }
    ledger = optimizer_state_ledger(optimizer)
    assert (ledger.bytes, ledger.elements) == expected_state(class_name, shapes_of(model))


@pytest.mark.parametrize("class_name", list(LAYOUT))
def test_ledger_counts_torchao_state_to_the_byte(class_name, uncompiled):
    from effitrain.memory.ledger import optimizer_state_ledger
    from effitrain.optim.low_bit import STATE_CLASSES

    model, optimizer = stepped(class_name)
    _, block, _ = LAYOUT[class_name]
    # Both sides of the rule, as the optimizer's own state_dict shows them.
    state = optimizer.state_dict()["state"]
    for index, p in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[index][key]
            full_name = f"{type(value).__module__}.{type(value).__qualname__}"
            assert (full_name in STATE_CLASSES) == quantized(p.numel(), block), (index, key)
            assert value.shape == p.shape  # the subclass's logical shape is the parameter's
    ledger = optimizer_state_ledger(optimizer)
    assert (ledger.bytes, ledger.elements) == expected_state(class_name, shapes_of(model))
    assert ledger.params_with_state == 5
    # The saved form (state_dict) counts the same.
    assert optimizer_state_ledger(optimizer.state_dict()).bytes == ledger.bytes
    # The quantized moments are far below the fp32 ones on the large matrix.
    large = {0: 4096, 1: 12288}
    fp32 = 2 * 4 * sum(large.values())
    quant = optimizer_state_ledger({i: state[i] for i in large}).bytes - 2 * 4
    assert quant < fp32 / 3


@pytest.mark.parametrize("class_name", list(LAYOUT))
def test_state_dict_round_trip_through_weights_only_load(class_name, tmp_path, uncompiled):
    from effitrain.inspection import safe_load
    from effitrain.optim.low_bit import build

    model, optimizer = stepped(class_name, steps=2)
    path = tmp_path / "optimizer.bin"
    torch.save(optimizer.state_dict(), path)
    loaded = safe_load(path)  # weights_only=True, torchao's classes allow-listed
    fresh = build(class_name, [{"params": list(model.parameters())}], 1e-3)
    fresh.load_state_dict(loaded)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = optimizer.state[p][key], fresh.state[p][key]
            assert type(a) is type(b)
            assert torch.equal(
                a.dequantize() if hasattr(a, "dequantize") else a,
                b.dequantize() if hasattr(b, "dequantize") else b,
            )
    # And the next step from both is identical.
    before = [p.detach().clone() for p in model.parameters()]
    model().backward()
    optimizer.step()
    after_a = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before, strict=True):
            p.copy_(b)
    fresh.step()
    for p, a in zip(model.parameters(), after_a, strict=True):
        assert torch.equal(p, a)


@pytest.mark.slow
def test_inspect_state_names_torchao_and_shapes_in_a_fresh_process(tmp_path, uncompiled):
    # A new process: nothing has imported torchao, so its classes are not yet allow-listed
    # anywhere; inspect-state must allow exactly them.
    model, optimizer = stepped("AdamW4bit")
    path = tmp_path / "optimizer.bin"
    torch.save(optimizer.state_dict(), path)
    proc = subprocess.run(
        [sys.executable, "-m", "effitrain", "inspect-state", str(path), "--json", "--top", "9"],
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["optimizer"]["class"] == "torchao.optim.AdamW4bit/Adam4bit"
    shapes = {tuple(row["shape"]): row["second_moment"] for row in report["largest"]}
    assert shapes[(128, 96)] == shapes[(64, 64)] == "4-bit (torchao)"
    assert shapes[(4095,)] == shapes[(50, 100)] == "full"
    assert report["optimizer_state"]["bytes"] == expected_state("AdamW4bit", shapes_of(model))[0]


def test_inspect_state_without_torchao_is_one_install_line(tmp_path, monkeypatch):
    import effitrain.optim.low_bit as optim_ao
    from effitrain.inspection import safe_load

    path = tmp_path / "optimizer.bin"
    torch.save({"state": {}, "param_groups": []}, path)  # what it would import is faked below
    monkeypatch.setattr(optim_ao, "state_classes", lambda: [])
    monkeypatch.setattr(
        torch.serialization,
        "get_unsafe_globals_in_checkpoint",
        lambda _: ["torchao.optim.subclass_8bit.OptimState8bit"],
    )
    with pytest.raises(EffitrainError, match=r"needs torchao: pip install 'effitrain\[ao\]'"):
        safe_load(path)


def test_other_classes_stay_refused_with_torchao_installed(tmp_path, monkeypatch):
    from effitrain.inspection import safe_load

    path = tmp_path / "optimizer.bin"
    torch.save({"state": {}, "param_groups": []}, path)
    monkeypatch.setattr(
        torch.serialization,
        "get_unsafe_globals_in_checkpoint",
        lambda _: ["torchao.optim.subclass_8bit.OptimState8bit", "os.system"],
    )
    with pytest.raises(EffitrainError, match=r"would import os\.system,"):
        safe_load(path)


# --------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------


def test_fp8_refused_on_a_gpu_below_sm89(monkeypatch):
    import effitrain.optim.low_bit as optim_ao

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA A10")
    monkeypatch.setattr(optim_ao, "_run_device", lambda _: torch.device("cuda", 0))
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(EffitrainError) as err:
        optim_ao.build("AdamWFp8", [{"params": [p]}], 1e-3)
    message = str(err.value)
    assert "compute capability >= 8.9" in message and "NVIDIA A10 is 8.6" in message
    assert "\n" not in message
    # sm89 and the other two optimizers are not refused.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (8, 9))
    optim_ao.check_fp8_device(torch.device("cuda", 0))
    assert type(optim_ao.build("AdamW8bit", [{"params": [p]}], 1e-3)).__name__ == "AdamW8bit"


def test_fp8_runs_on_cpu():
    from effitrain.optim.low_bit import check_fp8_device

    check_fp8_device(torch.device("cpu"))  # no refusal: it steps on CPU (ledger test above)


@pytest.mark.parametrize("name", list(NAMES))
def test_missing_torchao_is_one_install_line(name, monkeypatch):
    import importlib.util

    from effitrain.optim import build_optimizer

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m == "torchao" else real(m, *a)
    )
    with pytest.raises(EffitrainError, match=r"pip install 'effitrain\[ao\]'  \(torchao\)$"):
        build_optimizer(torch.nn.Linear(2, 2), name, 1e-3, 0.0)


def test_registry_entries():
    from effitrain.optim import OPTIMIZERS, state_bytes_per_param

    for name, class_name in NAMES.items():
        spec = OPTIMIZERS[name]
        assert spec.class_path == f"torchao.optim.{class_name}" and spec.module == "torchao"
        assert spec.per_parameter
        assert state_bytes_per_param(name) is not None  # measured (benchmarks/optimizer_costs)


# --------------------------------------------------------------------------------------------
# through the CLI, the update traced whole: exact resume, inspect-state on its checkpoint
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NAMES))
def test_resume_is_exact_and_inspect_state_names_it(
    name, train_cli, data, tmp_path, traced_not_inductor
):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    options = ("--optim", name, "--max-steps", "8", "--save-every", "4")
    proc = train_cli(*train_args(data, straight, *options))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-4", resumed / "checkpoint-4")
    proc = train_cli(*train_args(data, resumed, *options, "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compared = assert_identical(
        load_tensors(straight / "checkpoint-8"), load_tensors(resumed / "checkpoint-8")
    )
    assert compared > 40
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))

    proc = train_cli("inspect-state", str(straight / "checkpoint-8"), "--json", "--top", "100")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["optimizer"] == {
        "name": name,
        "class": f"torchao.optim.{NAMES[name]}",
        "inferred": False,
    }
    kind = {"adamw-8bit-ao": "8-bit", "adamw-4bit": "4-bit", "adamw-fp8": "fp8"}[name]
    block = LAYOUT[NAMES[name]][1]
    seen = set()
    for row in report["largest"]:  # every parameter, named, with its shape
        is_quantized = quantized(math.prod(row["shape"]), block)
        expected = f"{kind} (torchao)" if is_quantized else "full"
        assert row["second_moment"] == expected, row
        seen.add(is_quantized)
    assert seen == {True, False}  # both sides of torchao's rule in the tiny model
    # After 8 traced updates, the state is still the layout's, to the byte.
    shapes = [tuple(row["shape"]) for row in report["largest"]]
    assert len(shapes) == report["optimizer_state"]["params_with_state"] == 40
    state = report["optimizer_state"]
    assert (state["bytes"], state["elements"]) == expected_state(NAMES[name], shapes)


def test_fp8_refusal_through_the_cli(train_cli, data, tmp_path, monkeypatch):
    import effitrain.optim.low_bit as optim_ao

    def refuse(device):
        raise EffitrainError("--optim adamw-fp8 needs a GPU of compute capability >= 8.9 (test)")

    monkeypatch.setattr(optim_ao, "check_fp8_device", refuse)
    proc = train_cli(*train_args(data, tmp_path / "out", "--optim", "adamw-fp8"))
    assert_clean_error(proc, "compute capability >= 8.9")
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.parametrize("name", list(NAMES))
def test_optimizer_in_backward_is_refused(name):
    from effitrain.build import check_config
    from effitrain.config import TrainConfig

    with pytest.raises(EffitrainError) as error:
        check_config(
            TrainConfig(optim=name, optimizer_in_backward=True, max_grad_norm=0).validate()
        )
    message = str(error.value)
    assert "\n" not in message and f"--optim {name} cannot combine" in message
    assert "lr as a tensor" in message


# --------------------------------------------------------------------------------------------
# sharding rules (facts from 2 gloo CPU ranks, torch 2.13, torchao 0.18: see the README notes)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw-4bit", "adamw-fp8"])
def test_fsdp2_refuses_4bit_and_fp8(name):
    from effitrain import distributed
    from tests.test_distributed import fsdp

    with pytest.raises(EffitrainError) as error:
        distributed.optimizer_notes(fsdp(2), name)
    assert f"--optim {name} cannot run under FSDP2: torchao's" in str(error.value)


def test_fsdp2_accepts_8bit_ao_and_flat_shards_get_a_note():
    from effitrain import distributed
    from tests.test_distributed import deepspeed, fake_state, fsdp

    assert distributed.optimizer_notes(fsdp(2), "adamw-8bit-ao") == []
    for name, block in (("adamw-8bit-ao", 256), ("adamw-4bit", 128), ("adamw-fp8", 256)):
        (note,) = distributed.optimizer_notes(fsdp(1), name)
        assert note.startswith("FSDP1 hands the optimizer flat 1-D shards") and f"{block}" in note
        (note,) = distributed.optimizer_notes(deepspeed(2), name)
        assert note.startswith("DeepSpeed ZeRO-2 hands the optimizer flat 1-D shards")
        assert distributed.optimizer_notes(fake_state("MULTI_GPU"), name) == []
