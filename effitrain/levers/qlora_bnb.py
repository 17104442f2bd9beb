"""4-bit NF4 quantization through bitsandbytes (QLoRA's frozen base, ``--load-in-4bit``; a
4-bit reference copy, ``--reference-dtype 4bit``): which layers are quantized, how, and what the
quantized weights take, to the byte.

What is quantized: every ``nn.Linear`` (and GPT-2's ``Conv1D``) outside the output layer and the
classification head (:func:`kept_modules`), through transformers' own ``replace_with_bnb_linear``;
each weight becomes a ``bitsandbytes.nn.Params4bit`` (two 4-bit codes per byte) with a
``QuantState``: one absmax per block of 64 weights, the 16-value NF4 code, and with double
quantization (on, as in the QLoRA paper) the absmaxes themselves stored as 8-bit blockwise codes
(blocks of 256) with their own fp32 absmax, 256-value code and offset. Embeddings, norms, the
output layer and the head stay unquantized, in the dtype the model is read in: fp32, or bf16
with ``--weights-dtype bf16`` (the head that trains in full then goes back to fp32, as LoRA's
adapters are). The compute dtype (what each weight is dequantized to for its matmul) is bf16
under ``--mixed-precision bf16`` or ``--weights-dtype bf16``, else fp32.

bitsandbytes is imported inside the functions: it is an optional extra (``effitrain[qlora]``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from effitrain.errors import MissingPackage
from effitrain.levers.bf16_weights import Bf16WeightsOptions

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    import torch
    from transformers import PreTrainedModel

    from effitrain.config import TrainConfig

INSTALL = "pip install 'effitrain[qlora]'"
BLOCKSIZE = 64
"""Weights per absmax (bitsandbytes' default for 4-bit)."""
NESTED_BLOCKSIZE = 256
"""Absmaxes per nested absmax under double quantization (bitsandbytes' fixed value)."""
DOUBLE_QUANT = True
NF4_CODE_VALUES = 16
NESTED_CODE_VALUES = 256


def require_bitsandbytes() -> None:
    """Raises: EffitrainError with the install line when bitsandbytes is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingPackage(
            f"--load-in-4bit needs bitsandbytes, which is not installed: {INSTALL}"
        )


def quantization_config(config: TrainConfig) -> Any:
    """transformers' ``BitsAndBytesConfig`` for the run: NF4, double quantization, the compute
    dtype of :func:`compute_dtype`."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=getattr(torch, compute_dtype(config)),
        bnb_4bit_use_double_quant=DOUBLE_QUANT,
    )


def compute_dtype(config: TrainConfig) -> str:
    """What each 4-bit weight is dequantized to for its matmul: bf16 under bf16 autocast or
    with bf16 weights (the hidden states are bf16 then), else fp32."""
    weights = Bf16WeightsOptions.of(config).weights_dtype
    bf16 = config.mixed_precision == "bf16" or weights == "bf16"
    return "bfloat16" if bf16 else "float32"


def linear_4bit_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``model``'s bitsandbytes ``Linear4bit`` layers, by name (Any: bitsandbytes ships no
    types)."""
    import bitsandbytes as bnb

    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            yield name, module


def kept_modules(model: torch.nn.Module) -> list[str]:
    """The modules that keep their weights: the output layer (and what is tied to it) and the
    classification head, which trains in full (LoRA's ``modules_to_save``)."""
    from effitrain.models import head_modules

    kept = list(head_modules(model))
    # A transformers model: QLoRA quantizes it before any lever wraps it.
    output = cast("PreTrainedModel", model).get_output_embeddings()
    kept += [name for name, module in model.named_modules() if module is output and output]
    return kept


def replace_linear_layers(
    model: torch.nn.Module,
    config: TrainConfig,
    new_weight: Callable[[Any, torch.Tensor], Any] | None = None,
    replacing: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> torch.nn.Module:
    """Swap the Linear layers (outside :func:`kept_modules`) for bitsandbytes' ``Linear4bit``,
    each holding its original weight, not yet quantized (:func:`quantize_weights` does that on
    the run's device). Works on the meta device too (``effitrain estimate``). ``new_weight(layer,
    weight)``: what the new layer holds instead (default: a ``Params4bit`` of the weight);
    ``replacing``: a context around the swap itself."""
    require_bitsandbytes()
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    originals = {
        name: (module.weight, module.bias)
        for name, module in model.named_modules()
        if hasattr(module, "weight") and hasattr(module, "bias")
    }
    with replacing():
        replace_with_bnb_linear(model, kept_modules(model), quantization_config(config))
    for name, module in linear_4bit_layers(model):
        weight, bias = originals[name]
        if module.source_cls.__name__ == "Conv1D":  # GPT-2 stores [in, out]
            weight = weight.t()
        module.weight = (new_weight or _params_4bit)(module, weight)
        if bias is not None:
            module.bias = bias  # frozen by peft with the rest of the base
    no_cpu_repacking(model)
    return model


def _params_4bit(module: Any, weight: torch.Tensor) -> Any:
    """The layer's ``Params4bit`` holding ``weight`` (quantized when moved to the device)."""
    import bitsandbytes as bnb

    attributes = {k: v for k, v in vars(module.weight).items() if k != "module"}
    return bnb.nn.Params4bit(
        weight.data.contiguous(), requires_grad=False, module=module, **attributes
    )


def no_cpu_repacking(model: torch.nn.Module) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place for inference at
    the first forward without grad (evaluation): other numerics, lossy on the way back, and
    shapes it cannot repack (rows not a multiple of the block) fail. Turned off."""
    for _, module in linear_4bit_layers(model):
        module.support_avx512bf16_for_cpu = False


def quantize_weights(model: torch.nn.Module, device: torch.device | None) -> None:
    """Quantize every ``Linear4bit`` weight that is not yet quantized, on ``device``
    (``Params4bit.to`` runs bitsandbytes' ``quantize_4bit`` there; under ``effitrain
    estimate``'s fake tensors, its shape-only implementation)."""
    for _, module in linear_4bit_layers(model):
        if not module.weight.bnb_quantized:
            module.weight = module.weight.to(device)


def quantize_model(
    model: torch.nn.Module, config: TrainConfig, device: torch.device | None = None
) -> torch.nn.Module:
    """:func:`replace_linear_layers`, then :func:`quantize_weights` on ``device`` (default: where
    the model is). Nothing is quantized on the meta device: ``effitrain estimate`` quantizes
    once it has fake tensors. The model is then marked as transformers marks one it quantized
    while loading (``is_loaded_in_4bit``), so that peft gives it the same QLoRA layers."""
    import torch

    device = device if device is not None else next(model.parameters()).device
    replace_linear_layers(model, config)
    if torch.device(device).type != "meta":
        quantize_weights(model, device)
    # torch types Module.__setattr__ for tensors and modules; transformers reads this flag.
    model.is_loaded_in_4bit = True  # type: ignore[assignment]
    return model


SHARDABLE_STORAGE = "bfloat16"
"""The dtype that holds the packed 4-bit codes under FSDP2, which shards floating-point
parameters only (Accelerate leaves uint8 ones whole on every rank): bitsandbytes'
``bnb_4bit_quant_storage``, as Answer.AI's FSDP-QLoRA uses it. The same bytes, four codes per
element instead of two."""


def shardable_codes(model: torch.nn.Module) -> None:
    """Store every 4-bit weight's packed codes as :data:`SHARDABLE_STORAGE`: a view of the same
    bytes (bitsandbytes' own ``quantize_4bit(quant_storage=...)`` makes exactly that view), so
    the weights, their quant states and every matmul stay what they were; a weight not yet
    quantized (on the meta device) will be quantized into that storage."""
    import bitsandbytes as bnb
    import torch

    storage = getattr(torch, SHARDABLE_STORAGE)
    for _, module in linear_4bit_layers(model):
        module.quant_storage = storage
        weight = module.weight
        if not weight.bnb_quantized or weight.dtype == storage:
            weight.quant_storage = storage
            continue
        codes = weight.data.reshape(-1).view(storage).unsqueeze(1)
        module.weight = bnb.nn.Params4bit(
            codes,
            requires_grad=False,
            quant_state=weight.quant_state,
            blocksize=weight.blocksize,
            compress_statistics=weight.compress_statistics,
            quant_type=weight.quant_type,
            quant_storage=storage,
            module=module,
            bnb_quantized=True,
        )


def mark_sharded_weights(model: torch.nn.Module) -> None:
    """After FSDP2 sharded the model: each 4-bit weight is a DTensor of its codes, its
    ``QuantState`` left on its module (where bitsandbytes finds it again for each forward).
    Point the weight at it (:data:`effitrain.memory.ledger.SHARDED_QUANT_STATE`), so that the
    ledger counts it (whole, on every rank) and the banner and checks know the weight is 4-bit."""
    from effitrain.memory.ledger import SHARDED_QUANT_STATE

    for _, module in linear_4bit_layers(model):
        state = getattr(module, "quant_state", None)
        if state is not None:
            setattr(module.weight, SHARDED_QUANT_STATE, state)


def quantized_like(param: Any, weight: Any) -> Any:
    """``weight`` quantized as ``param`` (an unquantized ``Params4bit``) would be, through
    bitsandbytes' own ``quantize_4bit``, for ``effitrain estimate``'s fake tensors: a plain
    parameter holding the packed codes, with the ``QuantState`` attached as ``Params4bit``
    keeps it (a fake tensor cannot become a ``Params4bit``; ``Linear4bit`` reads only the
    ``quant_state`` attribute)."""
    import bitsandbytes as bnb
    import torch

    packed, state = bnb.functional.quantize_4bit(
        weight,
        blocksize=param.blocksize,
        compress_statistics=param.compress_statistics,
        quant_type=param.quant_type,
        quant_storage=param.quant_storage,
    )
    quantized = torch.nn.Parameter(packed, requires_grad=False)
    # torch's Tensor declares no free attributes; Linear4bit reads this one.
    quantized.quant_state = state  # type: ignore[attr-defined]
    return quantized


@dataclass
class QuantizedStorage:
    """What the 4-bit base weights take, to the byte."""

    weights: int = 0
    """4-bit weight tensors."""
    elements: int = 0
    """Weights they stand for (original shapes)."""
    packed_bytes: int = 0
    """The packed 4-bit codes (uint8, two per byte)."""
    quant_state_bytes: int = 0
    """Absmaxes, codes, offsets and nested absmaxes/codes."""

    @property
    def bytes(self) -> int:
        return self.packed_bytes + self.quant_state_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.bytes}


def storage(model: torch.nn.Module) -> QuantizedStorage:
    """Measure the 4-bit weights' real storages (each storage once, as the ledger counts)."""
    import torch

    from effitrain.memory.ledger import is_4bit, logical_numel, parameter_bytes

    params = [p for p in model.parameters() if is_4bit(p)]
    # The codes alone: this rank's shard of them under FSDP2.
    codes = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    packed = parameter_bytes([c.as_subclass(torch.Tensor) for c in codes])
    total = parameter_bytes(params)
    return QuantizedStorage(
        weights=len(params),
        elements=sum(logical_numel(p) for p in params),
        packed_bytes=packed,
        quant_state_bytes=total - packed,
    )


def expected_storage(shapes: list[tuple[int, int]]) -> QuantizedStorage:
    """What bitsandbytes stores for 4-bit NF4 weights of these ``[out, in]`` shapes, from the
    shapes alone (:func:`storage` measures it): per weight, numel/2 packed bytes (rounded up),
    and a QuantState: with double quantization one uint8 absmax per block of 64, a float32
    offset, a 16-value float32 NF4 code, one float32 nested absmax per block of 256 absmaxes
    and a 256-value float32 nested code; without it, float32 absmaxes and the code."""
    result = QuantizedStorage()
    for out_features, in_features in shapes:
        numel = out_features * in_features
        blocks = math.ceil(numel / BLOCKSIZE)
        state = 4 * NF4_CODE_VALUES
        if DOUBLE_QUANT:
            nested = math.ceil(blocks / NESTED_BLOCKSIZE)
            state += blocks + 4 + 4 * nested + 4 * NESTED_CODE_VALUES
        else:
            state += 4 * blocks
        result.weights += 1
        result.elements += numel
        result.packed_bytes += (numel + 1) // 2
        result.quant_state_bytes += state
    return result
