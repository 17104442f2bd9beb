"""Storage accounting checked against hand-computed numbers (effitrain.memory.ledger).

The small model used throughout is

    Sequential(Linear(128, 64), LayerNorm(64), Linear(64, 2))

with parameters (shape -> numel):
    0.weight (64, 128) -> 8192     0.bias (64,) -> 64
    1.weight (64,)     -> 64       1.bias (64,) -> 64
    2.weight (2, 64)   -> 128      2.bias (2,)  -> 2
    total 8514 elements in 6 tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from effitrain.memory.ledger import (  # noqa: E402
    BNB_QUANT_STATE_KEY,
    OptimizerStateLedger,
    adamw_equivalent_bytes,
    adamw_equivalent_elements,
    format_bytes,
    gradient_bytes,
    optimizer_state_ledger,
    parameter_bytes,
    peak_memory_bytes,
    tensor_storage,
    trainable_parameter_count,
)

N_TENSORS = 6
N_ELEMENTS = 8192 + 64 + 64 + 64 + 128 + 2  # 8514
ONE_D = 64 + 64 + 64 + 2  # 194 elements in 1-D params


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 2))


def one_step(model: nn.Module, optimizer) -> None:
    first = next(model.parameters())
    x = torch.randn(4, first.shape[1])
    model(x).pow(2).sum().backward()
    optimizer.step()


def key(ledger: OptimizerStateLedger, name: str) -> tuple[int, int, int, list[str]]:
    u = ledger.by_key[name]
    return (u.tensors, u.elements, u.bytes, u.dtypes)


def check_totals(ledger: OptimizerStateLedger) -> None:
    assert ledger.tensors == sum(u.tensors for u in ledger.by_key.values())
    assert ledger.elements == sum(u.elements for u in ledger.by_key.values())
    assert ledger.bytes == sum(u.bytes for u in ledger.by_key.values())


# --------------------------------------------------------------------------------------------
# import cost
# --------------------------------------------------------------------------------------------


def test_import_does_not_import_torch():
    code = "import sys, effitrain.memory.ledger; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# optimizers, one step each
# --------------------------------------------------------------------------------------------


def test_adamw_ledger():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one_step(model, opt)
    ledger = optimizer_state_ledger(opt)
    check_totals(ledger)
    assert list(ledger.by_key) == ["step", "exp_avg", "exp_avg_sq"]
    assert key(ledger, "step") == (6, 6, 24, ["float32"])
    assert key(ledger, "exp_avg") == (6, N_ELEMENTS, 4 * N_ELEMENTS, ["float32"])
    assert key(ledger, "exp_avg_sq") == (6, N_ELEMENTS, 4 * N_ELEMENTS, ["float32"])
    assert ledger.params_with_state == N_TENSORS
    assert ledger.tensors == 18
    assert ledger.elements == 2 * N_ELEMENTS + 6 == 17034
    assert ledger.bytes == 8 * N_ELEMENTS + 24 == 68136
    # The reference agrees with a real fp32 AdamW.
    assert adamw_equivalent_elements(model) == ledger.elements
    assert adamw_equivalent_bytes(model) == ledger.bytes
    # The same numbers from state mapping / state_dict / whole state_dict.
    for source in (opt.state, opt.state_dict()["state"], opt.state_dict()):
        assert optimizer_state_ledger(source).to_dict() == ledger.to_dict()


def test_adamw_before_step_is_empty():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    ledger = optimizer_state_ledger(opt)
    assert ledger.to_dict() == {
        "tensors": 0,
        "elements": 0,
        "bytes": 0,
        "params_with_state": 0,
        "by_key": {},
    }


def test_sgd_momentum_ledger():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one_step(model, opt)
    ledger = optimizer_state_ledger(opt)
    assert list(ledger.by_key) == ["momentum_buffer"]
    assert key(ledger, "momentum_buffer") == (6, N_ELEMENTS, 4 * N_ELEMENTS, ["float32"])
    assert ledger.bytes == 34056


def test_torch_adafactor_ledger():
    model = small_model()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    one_step(model, opt)
    ledger = optimizer_state_ledger(opt)
    check_totals(ledger)
    # torch 2.13: row_var has shape[:-1] + (1,), col_var shape[:-2] + (1, n): (64,1)/(1,128)
    # and (2,1)/(1,64); 1-D params keep a full "variance".
    assert set(ledger.by_key) == {"step", "row_var", "col_var", "variance"}
    assert key(ledger, "step") == (6, 6, 24, ["float32"])
    assert key(ledger, "row_var") == (2, 64 + 2, 4 * 66, ["float32"])
    assert key(ledger, "col_var") == (2, 128 + 64, 4 * 192, ["float32"])
    assert key(ledger, "variance") == (4, ONE_D, 4 * ONE_D, ["float32"])
    assert ledger.elements == 6 + 66 + 192 + 194 == 458
    assert ledger.bytes == 4 * 458 == 1832


def test_torch_adafactor_factors_last_two_dims_only():
    # A 3-D parameter (3, 4, 5): row_var (3, 4, 1) = 12, col_var (3, 1, 5) = 15.
    p = nn.Parameter(torch.randn(3, 4, 5))
    opt = torch.optim.Adafactor([p], lr=1e-2)
    p.pow(2).sum().backward()
    opt.step()
    ledger = optimizer_state_ledger(opt)
    assert key(ledger, "row_var")[1] == 12
    assert key(ledger, "col_var")[1] == 15
    assert ledger.elements == 1 + 12 + 15


def _hf_adafactor(params, **kw):
    transformers = pytest.importorskip("transformers")
    return transformers.optimization.Adafactor(
        params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False, **kw
    )


def test_hf_adafactor_ledger():
    model = small_model()
    opt = _hf_adafactor(model.parameters())
    one_step(model, opt)
    ledger = optimizer_state_ledger(opt)
    check_totals(ledger)
    assert set(ledger.by_key) == {"step", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"}
    # step is a Python int: 1 element, 8 bytes each, no tensor.
    assert key(ledger, "step") == (0, 6, 48, ["python int"])
    # Row/col factors are 1-D: (64,)/(128,) and (2,)/(64,).
    assert key(ledger, "exp_avg_sq_row") == (2, 66, 264, ["float32"])
    assert key(ledger, "exp_avg_sq_col") == (2, 192, 768, ["float32"])
    assert key(ledger, "exp_avg_sq") == (4, ONE_D, 4 * ONE_D, ["float32"])
    # transformers 5.24: RMS starts as int 0 and becomes a 0-d float32 tensor after a step.
    rms = ledger.by_key["RMS"]
    assert rms.elements == 6
    assert rms.dtypes in (["float32"], ["python float"], ["python int"])
    assert ledger.params_with_state == 6


def test_hf_adafactor_with_beta1_keeps_exp_avg():
    model = small_model()
    opt = _hf_adafactor(model.parameters(), beta1=0.9)
    one_step(model, opt)
    ledger = optimizer_state_ledger(opt)
    assert key(ledger, "exp_avg") == (6, N_ELEMENTS, 4 * N_ELEMENTS, ["float32"])
    without = optimizer_state_ledger(_stepped_hf_adafactor_no_beta())
    assert ledger.bytes - without.bytes == 4 * N_ELEMENTS


def _stepped_hf_adafactor_no_beta():
    model = small_model()
    opt = _hf_adafactor(model.parameters())
    one_step(model, opt)
    return opt


def test_python_scalar_rule():
    state = {0: {"step": 3, "RMS": 0.5, "flag": True, "note": "ignored", "none": None}}
    ledger = optimizer_state_ledger(state)
    assert key(ledger, "step") == (0, 1, 8, ["python int"])
    assert key(ledger, "RMS") == (0, 1, 8, ["python float"])
    assert key(ledger, "flag") == (0, 1, 8, ["python bool"])
    assert "note" not in ledger.by_key and "none" not in ledger.by_key
    assert ledger.tensors == 0 and ledger.elements == 3 and ledger.bytes == 24
    assert ledger.params_with_state == 1


# bitsandbytes model: two weights >= 4096 elements (quantized), the rest small (fp32 state).
#   0.weight (64, 128) 8192  | 2.weight (128, 64) 8192      -> uint8 state1/state2
#   small: 0.bias 64, 1.weight 64, 1.bias 64, 2.bias 128, 3.weight (2,128) 256, 3.bias 2 = 578
BNB_BIG = 2 * 8192
BNB_SMALL = 64 + 64 + 64 + 128 + 256 + 2
BNB_BLOCK = 256  # blockwise quantization block size (observed: 8192 elements -> 32 absmax)


def _bnb_stepped():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 2)
    )
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)  # min_8bit_size=4096 (default)
    one_step(model, opt)
    return model, opt


def test_bnb_adamw8bit_ledger():
    model, opt = _bnb_stepped()
    ledger = optimizer_state_ledger(opt)
    check_totals(ledger)
    assert set(ledger.by_key) == {
        "step",
        "state1",
        "state2",
        "qmap1",
        "qmap2",
        "absmax1",
        "absmax2",
    }
    assert key(ledger, "step") == (0, 8, 64, ["python int"])
    state_bytes = BNB_BIG * 1 + BNB_SMALL * 4  # uint8 for the big ones, fp32 for the small
    for name in ("state1", "state2"):
        assert key(ledger, name) == (8, BNB_BIG + BNB_SMALL, state_bytes, ["float32", "uint8"])
    # qmaps are one tensor shared by all quantized params: counted ONCE (256 float32).
    for name in ("qmap1", "qmap2"):
        assert key(ledger, name) == (1, 256, 1024, ["float32"])
    n_absmax = 2 * (8192 // BNB_BLOCK)
    for name in ("absmax1", "absmax2"):
        assert key(ledger, name) == (2, n_absmax, 4 * n_absmax, ["float32"])
    assert ledger.params_with_state == 8
    expected = 64 + 2 * state_bytes + 2 * 1024 + 2 * 4 * n_absmax
    assert ledger.bytes == expected == 40016
    # Far less than fp32 AdamW for the same params.
    assert adamw_equivalent_bytes(model) == 8 * (BNB_BIG + BNB_SMALL) + 4 * 8 == 135728


def test_bnb_state_dict_same_keys_and_numbers(tmp_path):
    _model, opt = _bnb_stepped()
    live = optimizer_state_ledger(opt)
    sd = opt.state_dict()
    assert any(BNB_QUANT_STATE_KEY in entry for entry in sd["state"].values())
    from_sd = optimizer_state_ledger(sd)
    assert from_sd.to_dict()["by_key"].keys() == live.to_dict()["by_key"].keys()
    assert (from_sd.tensors, from_sd.elements, from_sd.bytes) == (
        live.tensors,
        live.elements,
        live.bytes,
    )
    # After a save/load round trip the shared qmaps are still one storage each.
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)
    from_file = optimizer_state_ledger(loaded["state"])
    assert from_file.bytes == live.bytes
    assert key(from_file, "qmap1") == (1, 256, 1024, ["float32"])


def test_nested_dict_keys_are_joined():
    t = torch.zeros(3)
    ledger = optimizer_state_ledger({0: {"outer": {"inner": t, "n": 1}}})
    assert list(ledger.by_key) == ["outer.inner", "outer.n"]
    assert key(ledger, "outer.inner") == (1, 3, 12, ["float32"])


# --------------------------------------------------------------------------------------------
# deduplication and wrappers
# --------------------------------------------------------------------------------------------


def test_shared_tensor_counts_once():
    t = torch.zeros(10)
    ledger = optimizer_state_ledger({0: {"a": t}, 1: {"a": t, "b": t}})
    assert ledger.tensors == 1
    assert ledger.bytes == 40 and ledger.elements == 10
    assert key(ledger, "a") == (1, 10, 40, ["float32"])
    # "b" was seen but brought nothing new
    assert key(ledger, "b") == (0, 0, 0, ["float32"])
    assert ledger.params_with_state == 2


def test_view_counts_whole_storage_once():
    base = torch.zeros(100)
    view = base[10:20]
    assert tensor_storage(view)[0][1:] == (400, 100, "float32")
    ledger = optimizer_state_ledger({0: {"v": view}, 1: {"w": base[50:]}})
    assert ledger.bytes == 400 and ledger.elements == 100 and ledger.tensors == 1


def test_tensor_storage_meta_and_empty():
    assert tensor_storage(torch.empty(5, 5, device="meta")) == [(None, 0, 0, "float32")]
    assert tensor_storage(torch.empty(0, dtype=torch.bfloat16)) == [(None, 0, 0, "bfloat16")]
    ledger = optimizer_state_ledger({0: {"m": torch.empty(3, device="meta")}})
    assert (ledger.tensors, ledger.bytes) == (1, 0)


def test_tensor_storage_plain():
    t = torch.zeros(4, 4, dtype=torch.float16)
    [(storage_key, nbytes, elements, dtype)] = tensor_storage(t)
    assert storage_key == (t.untyped_storage().data_ptr(), "cpu")
    assert (nbytes, elements, dtype) == (32, 16, "float16")


def test_wrapper_with_optimizer_attribute_is_unwrapped():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    one_step(model, opt)

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert optimizer_state_ledger(Wrapper(opt)).bytes == 68136


def test_accelerated_optimizer_is_unwrapped():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    model = small_model()
    try:
        acc = accelerate.Accelerator(cpu=True)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        assert type(opt).__name__ == "AcceleratedOptimizer"
        one_step(model, opt)
        assert optimizer_state_ledger(opt).bytes == 68136
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_not_an_optimizer_is_a_type_error():
    with pytest.raises(TypeError):
        optimizer_state_ledger(object())


def test_dtensor_is_unwrapped(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:
        pytest.skip("no DTensor in this torch")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    try:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    except Exception as exc:  # pragma: no cover - environment-specific
        pytest.skip(f"cannot start a single-process gloo group: {exc}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        assert type(dt).__name__ == "DTensor"
        local = dt.to_local()
        [(storage_key, nbytes, elements, dtype)] = tensor_storage(dt)
        assert storage_key[0] == local.untyped_storage().data_ptr()
        assert (nbytes, elements, dtype) == (128, 32, "float32")

        # AdamW over a DTensor parameter keeps DTensor state: counted via the local shard.
        p = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        opt = torch.optim.AdamW([p], lr=1e-3)
        p.pow(2).sum().backward()
        opt.step()
        ledger = optimizer_state_ledger(opt)
        assert key(ledger, "exp_avg") == (1, 32, 128, ["float32"])
        assert ledger.bytes == adamw_equivalent_bytes([p]) == 2 * 128 + 4
        assert parameter_bytes([p]) == 128
        assert trainable_parameter_count([p]) == 32
    finally:
        dist.destroy_process_group()


def test_torchao_low_bit_state_is_unwrapped():
    # The state tensors torchao.optim.AdamW8bit / AdamW4bit keep for a weight of >= 4096
    # elements, built directly (a real step goes through torch.compile: too slow for a unit
    # test). They claim numel * 4 bytes; the truth is their inner tensors.
    pytest.importorskip("torchao")
    try:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        pytest.skip("torchao without low-bit optimizer state subclasses")

    s8 = OptimState8bit.zeros((64, 256), signed=True, block_size=256)
    s4 = OptimState4bit.zeros((64, 256), signed=False, block_size=128)
    assert s8.numel() * s8.element_size() == 65536  # what it claims

    def inner_bytes(t):
        names, _ = t.__tensor_flatten__()
        return sum(getattr(t, n).untyped_storage().nbytes() for n in names)

    # 8-bit: codes 16384 uint8 + scale 64 float32 (one per 256-block) + qmap 256 float32
    assert inner_bytes(s8) == 16384 + 64 * 4 + 256 * 4 == 17664
    # 4-bit: codes 8192 uint8 (two per byte) + scale 128 float32 + qmap 16 float32
    assert inner_bytes(s4) == 8192 + 128 * 4 + 16 * 4 == 8768

    assert sum(b for _, b, _, _ in tensor_storage(s8)) == 17664
    assert sorted({d for *_, d in tensor_storage(s8)}) == ["float32", "uint8"]
    step = torch.tensor(1.0)
    ledger = optimizer_state_ledger({0: {"step": step, "exp_avg": s8, "exp_avg_sq": s4}})
    assert key(ledger, "exp_avg") == (1, 16384 + 64 + 256, 17664, ["float32", "uint8"])
    assert key(ledger, "exp_avg_sq") == (1, 8192 + 128 + 16, 8768, ["float32", "uint8"])
    assert ledger.bytes == 4 + 17664 + 8768


# --------------------------------------------------------------------------------------------
# parameters and gradients
# --------------------------------------------------------------------------------------------


def test_parameter_counts_and_bytes():
    model = small_model()
    assert trainable_parameter_count(model) == N_ELEMENTS
    assert parameter_bytes(model) == 4 * N_ELEMENTS
    assert adamw_equivalent_elements(model) == 2 * N_ELEMENTS + 6
    assert adamw_equivalent_bytes(model) == 8 * N_ELEMENTS + 24
    # frozen params are not trainable, but still take memory
    model[0].weight.requires_grad_(False)
    assert trainable_parameter_count(model) == N_ELEMENTS - 8192
    assert adamw_equivalent_elements(model) == 2 * (N_ELEMENTS - 8192) + 5
    assert parameter_bytes(model) == 4 * N_ELEMENTS
    # param groups are accepted too
    groups = [{"params": [model[0].bias]}, {"params": [model[2].weight, model[2].bias]}]
    assert adamw_equivalent_elements(groups) == 2 * (64 + 128 + 2) + 3


def test_tied_parameters_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.emb.weight  # shared Parameter, like HF tie_weights

    model = Tied()
    assert parameter_bytes(model) == 1600 * 4
    assert trainable_parameter_count(model) == 1600
    assert adamw_equivalent_elements(model) == 2 * 1600 + 1

    # Two distinct Parameter objects over one storage: memory once, count once.
    a = nn.Parameter(torch.zeros(10, 10))
    b = nn.Parameter(a.data)
    assert parameter_bytes([a, b]) == 400
    assert trainable_parameter_count([a, b]) == 100


def test_gradient_bytes():
    model = small_model()
    assert gradient_bytes(model) == 0
    model(torch.randn(4, 128)).sum().backward()
    assert gradient_bytes(model) == 4 * N_ELEMENTS
    model.zero_grad(set_to_none=True)
    assert gradient_bytes(model) == 0


def test_bf16_params():
    model = small_model().to(torch.bfloat16)
    assert parameter_bytes(model) == 2 * N_ELEMENTS
    # The fp32 reference does not follow the parameter dtype.
    assert adamw_equivalent_bytes(model) == 8 * N_ELEMENTS + 24


def _distilbert(device=None):
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(vocab_size=28996, num_labels=2)
    if device is None:
        return transformers.DistilBertForSequenceClassification(config)
    with torch.device(device):
        return transformers.DistilBertForSequenceClassification(config)


def test_distilbert_seed_numbers():
    # distilbert-base-cased for sequence classification, built on the meta device (instant).
    model = _distilbert("meta")
    assert len(list(model.parameters())) == 104
    assert trainable_parameter_count(model) == 65_783_042
    assert adamw_equivalent_elements(model) == 131_566_188
    assert adamw_equivalent_bytes(model) == 131_566_188 * 4 == 526_264_752
    assert format_bytes(adamw_equivalent_bytes(model)) == "501.9 MiB"  # "≈ 502 MiB"
    assert parameter_bytes(model) == 0  # meta tensors have no storage


@pytest.mark.slow
def test_distilbert_real_adamw_step():
    # One real AdamW step on the architecture: the ledger agrees. The values do not matter
    # for accounting, so skip random init (to_empty) and forward/backward (zero grads).
    model = _distilbert("meta").to_empty(device="cpu")
    assert parameter_bytes(model) == 65_783_042 * 4
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert gradient_bytes(model) == 65_783_042 * 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    opt.step()
    ledger = optimizer_state_ledger(opt)
    assert ledger.elements == 131_566_188
    assert ledger.tensors == 3 * 104
    assert ledger.bytes == 131_566_188 * 4
    assert ledger.params_with_state == 104
    model.zero_grad(set_to_none=True)
    assert gradient_bytes(model) == 0


# --------------------------------------------------------------------------------------------
# peak memory and formatting
# --------------------------------------------------------------------------------------------


def test_peak_memory_on_cpu():
    n, kind = peak_memory_bytes()
    assert isinstance(n, int) and n > 0
    if not torch.cuda.is_available():
        assert kind == "peak_rss"
    n_cpu, kind_cpu = peak_memory_bytes("cpu")
    assert kind_cpu == "peak_rss" and n_cpu > 0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (812, "812 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024**2 - 1, "1.0 MiB"),
        (526_264_752, "501.9 MiB"),
        (502 * 1024**2, "502.0 MiB"),
        (3 * 1024**3 // 2, "1.5 GiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_the_run_peak_on_cuda_survives_the_tracked_steps_reset(monkeypatch):
    """The step-memory breakdown resets CUDA's peak counter before its step; the run's peak
    (``peak_memory_bytes``) must still be the whole run's, not the tracked step's."""
    from effitrain.memory import ledger as memory

    allocated = {"max": 0}
    monkeypatch.setattr(memory, "_CUDA_PEAK_BEFORE_RESET", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["max"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(max=0)
    )
    cuda = torch.device("cuda", 0)
    allocated["max"] = 900  # an early step (or evaluation) peaked at 900
    memory.reset_cuda_peak(cuda)  # the tracked step starts
    allocated["max"] = 600  # the tracked step's own peak
    assert torch.cuda.max_memory_allocated(cuda) == 600  # what the breakdown reads
    assert peak_memory_bytes(cuda) == (900, "cuda_peak_allocated")
    allocated["max"] = 1200  # evaluation after it peaks higher
    assert peak_memory_bytes(torch.device("cuda")) == (1200, "cuda_peak_allocated")
