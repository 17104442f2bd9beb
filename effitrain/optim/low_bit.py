"""torchao's low-bit AdamW (``torchao.optim``): 8-bit, 4-bit and FP8 moments.

Layout (torchao 0.18, ``torchao/optim/adam.py`` ``_new_buffer``): a parameter whose local
tensor has at least 4096 elements *and* a multiple of ``block_size`` elements keeps
``exp_avg``/``exp_avg_sq`` as tensor subclasses (``OptimState8bit``/``OptimState4bit``/
``OptimStateFp8``), whose logical shape is the parameter's; any other parameter keeps plain
fp32 tensors. Inside the subclasses: ``codes`` (uint8, one per element; 4-bit packs two per
byte; FP8 ``float8_e4m3fn``), ``scale`` (fp32, one per block: 256 elements for 8-bit and FP8,
128 for 4-bit) and, for 8/4-bit, a ``qmap`` lookup table (fp32, 256 or 16 values) per state
tensor. ``step`` is a 0-d fp32 tensor; each group's ``lr`` becomes a 0-d tensor.

The step is ``torch.compile(fullgraph=True)``-d by torchao, with no eager path: the first step
compiles (inductor, C++ on CPU) once per distinct parameter shape and state kind.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    import torch

STATE_CLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit": "8-bit",
    "torchao.optim.subclass_4bit.OptimState4bit": "4-bit",
    "torchao.optim.subclass_fp8.OptimStateFp8": "fp8",
}
"""torchao's optimizer-state tensor subclasses (pickled by their full name) and the storage they
stand for. Only these are allow-listed for the weights-only loader."""

OPTIMIZER_OF_STATE = {
    "OptimState8bit": "torchao.optim.AdamW8bit/Adam8bit",
    "OptimState4bit": "torchao.optim.AdamW4bit/Adam4bit",
    "OptimStateFp8": "torchao.optim.AdamWFp8/AdamFp8",
}

FP8_MIN_CAPABILITY = (8, 9)


def _quiet_import() -> Any:
    """``torchao.optim``, without torchao's start-up log lines (CUDA-only kernels it cannot
    load on a CPU build; a pytree deprecation notice)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.optim
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    # Compiling the step warns once per subclass about an AOT-autograd cache hash it lacks.
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
    return torchao.optim


def build_quantization_maps() -> None:
    """Build torchao's quantization maps for real, before any fake-tensor work.

    torchao builds each map on first use (``.tolist()`` of a linspace) and caches it for the
    process; under ``effitrain estimate``'s fake tensors every value would be a placeholder,
    and every later real run in that process would quantize with that map.
    """
    _quiet_import()
    from torchao.optim import subclass_4bit, subclass_8bit

    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed()
        module.get_qmap_unsigned()


def state_classes() -> list[type]:
    """torchao's optimizer-state classes, or [] when torchao is not installed."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return []
    _quiet_import()
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return [OptimState8bit, OptimState4bit, OptimStateFp8]


def _run_device(groups: list[dict[str, Any]]) -> torch.device:
    """The device the step will run on: accelerate's, once a run has set it up; else the
    parameters'."""
    import torch

    try:
        from accelerate.state import PartialState

        if PartialState._shared_state:  # set up by this run (build_accelerator)
            return torch.device(PartialState().device)
    except ImportError:
        pass
    for group in groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def check_fp8_device(device: torch.device) -> None:
    """AdamWFp8 runs on CPU and on CUDA GPUs of compute capability >= 8.9 (FP8 hardware)."""
    import torch

    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_MIN_CAPABILITY:
            raise EffitrainError(
                f"--optim adamw-fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or "
                f"newer) or the CPU; {torch.cuda.get_device_name(device)} is "
                f"{capability[0]}.{capability[1]}: use adamw-8bit-ao or adamw-4bit"
            )
    elif device.type not in ("cpu", "cuda"):
        raise EffitrainError(f"--optim adamw-fp8 runs on the CPU or CUDA, not on {device.type}")


def build(class_name: str, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """``torchao.optim.<class_name>`` over ``groups`` with torchao's defaults (betas, eps,
    block size); weight decay comes from the groups."""
    if class_name == "AdamWFp8":
        check_fp8_device(_run_device(groups))
    optim = _quiet_import()
    return getattr(optim, class_name)(groups, lr=lr)
