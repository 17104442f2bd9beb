"""QLoRA's frozen base: ``--load-in-4bit`` stores the base model's Linear weights in 4-bit NF4
(bitsandbytes), under LoRA's adapters (``--lora-rank``).

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

A checkpoint is quantized while it is read, tensor by tensor, by transformers' bitsandbytes
integration (``from_pretrained(quantization_config=BitsAndBytesConfig(...))``, the kept modules
named from the model built on the meta device first): no full-precision copy of the base
exists. A preset (random init) is built first, then quantized where the run trains
(``Params4bit.to(device)``), as ``effitrain estimate`` does on fake tensors. Both run
bitsandbytes' ``quantize_4bit`` on each weight as read in: from fp32 (the default) the codes
and quant states equal those of quantizing the fp32 model after loading, byte for byte; from
bf16 the codes are the same and the quant state records bf16 as the weight's dtype. A resumed
run reads ``--model`` the same way, so it rebuilds the identical frozen base.

peft's ``prepare_model_for_kbit_training`` is not called: it casts fp16/bf16 parameters to fp32
(the adapters are fp32 already) and turns on reentrant gradient checkpointing behind the user's
back; ``--gradient-checkpointing`` is the explicit switch (non-reentrant, which needs no input
grads).

bitsandbytes is imported inside the functions: it is an optional extra (``effitrain[qlora]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError, MissingPackage
from effitrain.levers.spec import BuiltRun, Lever, Search
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.models import LoadOptions

INSTALL = "pip install 'effitrain[qlora]'"
BLOCKSIZE = 64
"""Weights per absmax (bitsandbytes' default for 4-bit)."""
NESTED_BLOCKSIZE = 256
"""Absmaxes per nested absmax under double quantization (bitsandbytes' fixed value)."""
DOUBLE_QUANT = True
NF4_CODE_VALUES = 16
NESTED_CODE_VALUES = 256


@dataclass
class QLoRAOptions(OptionGroup):
    """``--load-in-4bit``."""

    load_in_4bit: bool = option_field(
        False,
        "QLoRA: store the frozen base model's Linear weights in 4-bit NF4 (bitsandbytes) under "
        "the LoRA adapters; needs --lora-rank.",
        panel=MEMORY_LEVERS,
    )


class QLoRA(Lever):
    name = "load-in-4bit"
    options = QLoRAOptions
    removes = "7/8 of the frozen base's Linear weights (4-bit NF4 codes and their scales)"
    packages = ("bitsandbytes", "peft")
    install = INSTALL
    strict_load = False  # Accelerate cannot load bitsandbytes' quant-state keys: checked here
    search = Search((False, True), order=50)
    time_cost = "each weight is dequantized for its matmul, forward and backward"

    def is_on(self, config: TrainConfig) -> bool:
        return config.load_in_4bit

    def check(self, config: TrainConfig) -> None:
        if config.lora_rank is None:
            raise EffitrainError(
                "--load-in-4bit needs --lora-rank R: 4-bit weights are frozen, only LoRA "
                "adapters can train over them; add --lora-rank 8"
            )
        if config.lora_merge:
            raise EffitrainError(
                "--load-in-4bit cannot combine with --lora-merge: merging into 4-bit weights "
                "re-quantizes them (lossy); keep final/'s adapters and merge them into the "
                "original weights (peft's merge_and_unload on the fp32 model)"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        require_bitsandbytes()  # under FSDP1 and DeepSpeed, LoRA refuses the launch
        if launch.sharding.kind != "fsdp2":
            return
        if config.mixed_precision == "fp16":
            raise EffitrainError(
                "--load-in-4bit with --mixed-precision fp16 cannot run under FSDP2: its "
                "all-gather casts every parameter to fp16, and the 4-bit codes are stored as "
                "bf16 there (so that they shard); use --mixed-precision bf16 or no"
            )
        plugin = getattr(launch.state, "fsdp_plugin", None)
        kind = getattr(plugin, "state_dict_type", None)
        if kind is not None and "SHARDED" not in str(getattr(kind, "name", kind)):
            raise EffitrainError(
                f"--load-in-4bit under FSDP2 needs fsdp_state_dict_type: SHARDED_STATE_DICT "
                f"(this config has {getattr(kind, 'name', kind)}): a resume checks the sharded "
                "checkpoint's 4-bit base against --model, and the full format has not been run"
            )

    def for_launch(self, model: torch.nn.Module, config: TrainConfig, launch: Launch) -> None:
        if launch.sharding.kind == "fsdp2":
            shardable_codes(model)

    def after_prepare(self, run: BuiltRun) -> None:
        if run.launch.sharding.kind == "fsdp2":
            mark_sharded_weights(run.accelerator.unwrap_model(run.model))

    def load_options(self, config: TrainConfig, options: LoadOptions) -> LoadOptions:
        return dataclasses.replace(
            options,
            quantization_config=quantization_config(config),
            keep_unquantized=kept_modules,
        )

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> Any:
        if getattr(model, "is_loaded_in_4bit", False):  # quantized while it was read
            no_cpu_repacking(model)
            return model
        return quantize_model(model, config, device)

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return describe(model, config)

    def metrics(self, run: BuiltRun) -> dict[str, Any]:
        return {"quantized_weights": storage(run.model).to_dict()}

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        quantized = metrics.get("quantized_weights")
        if not quantized:
            return []
        from effitrain.memory.ledger import format_bytes

        return [
            MemoryRow(
                f"  4-bit NF4: packed {format_bytes(quantized['packed_bytes'])} + quant state "
                f"{format_bytes(quantized['quant_state_bytes'])}",
                quantized["bytes"],
                part_of="parameters",
                at_peak=step.quantized_at_peak if step else None,
            )
        ]

    def fake_tensor(self, original: Any, empty: Any) -> Any | None:
        from effitrain.memory.ledger import is_4bit

        return quantized_like(original, empty) if is_4bit(original) else None

    def check_checkpoint(self, run: BuiltRun, checkpoint: Path) -> None:
        model = run.accelerator.unwrap_model(run.model)
        if run.launch.sharding.kind == "fsdp2":
            check_sharded_checkpoint_base(run.accelerator, model, checkpoint)
        else:
            check_checkpoint_base(model, checkpoint)


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
    bf16 = config.mixed_precision == "bf16" or config.weights_dtype == "bf16"
    return "bfloat16" if bf16 else "float32"


def kept_modules(model: torch.nn.Module) -> list[str]:
    """The modules that keep their weights: the output layer (and what is tied to it) and the
    classification head, which trains in full (LoRA's ``modules_to_save``)."""
    from effitrain.models import head_modules

    kept = list(head_modules(model))
    output = model.get_output_embeddings()
    kept += [name for name, module in model.named_modules() if module is output and output]
    return kept


def replace_linear_layers(
    model: torch.nn.Module,
    config: TrainConfig,
    new_weight: Callable[[Any, torch.Tensor], Any] | None = None,
    replacing: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Any:
    """Swap the Linear layers (outside :func:`kept_modules`) for bitsandbytes' ``Linear4bit``,
    each holding its original weight, not yet quantized (:func:`quantize_weights` does that on
    the run's device). Works on the meta device too (``effitrain estimate``). ``new_weight(layer,
    weight)``: what the new layer holds instead (default: a ``Params4bit`` of the weight);
    ``replacing``: a context around the swap itself."""
    require_bitsandbytes()
    import bitsandbytes as bnb
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    originals = {
        name: (module.weight, module.bias)
        for name, module in model.named_modules()
        if hasattr(module, "weight") and hasattr(module, "bias")
    }
    with replacing():
        replace_with_bnb_linear(model, kept_modules(model), quantization_config(config))
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
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
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def quantize_weights(model: torch.nn.Module, device: torch.device | None) -> None:
    """Quantize every ``Linear4bit`` weight that is not yet quantized, on ``device``
    (``Params4bit.to`` runs bitsandbytes' ``quantize_4bit`` there; under ``effitrain
    estimate``'s fake tensors, its shape-only implementation)."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and not module.weight.bnb_quantized:
            module.weight = module.weight.to(device)


def quantize_model(
    model: torch.nn.Module, config: TrainConfig, device: torch.device | None = None
) -> Any:
    """:func:`replace_linear_layers`, then :func:`quantize_weights` on ``device`` (default: where
    the model is). Nothing is quantized on the meta device: ``effitrain estimate`` quantizes
    once it has fake tensors. The model is then marked as transformers marks one it quantized
    while loading (``is_loaded_in_4bit``), so that peft gives it the same QLoRA layers."""
    import torch

    device = device if device is not None else next(model.parameters()).device
    replace_linear_layers(model, config)
    if torch.device(device).type != "meta":
        quantize_weights(model, device)
    model.is_loaded_in_4bit = True
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
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
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
    import bitsandbytes as bnb

    from effitrain.memory.ledger import SHARDED_QUANT_STATE

    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if isinstance(module, bnb.nn.Linear4bit) and state is not None:
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
    quantized.quant_state = state
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


def describe(model: torch.nn.Module, config: TrainConfig) -> str:
    """One banner line: what is 4-bit, what is kept, the compute dtype, the bytes."""
    import bitsandbytes as bnb

    from effitrain.memory.ledger import format_bytes
    from effitrain.models import base_model

    base = base_model(model)
    names = [n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    # Under peft the layer is "<name>.base_layer": name it by the layer it stands for.
    layers = [n.removesuffix(".base_layer").rsplit(".", 1)[-1] for n in names]
    measured = storage(base)
    compute = {"bfloat16": "bf16", "float32": "fp32"}[compute_dtype(config)]
    kept = ", ".join(kept_modules(base)) or "no Linear layer"
    return (
        f"4-bit NF4 base (bitsandbytes, double quantization, blocks of {BLOCKSIZE}, compute "
        f"{compute}): {len(names)} Linear layers ({', '.join(dict.fromkeys(layers))}), "
        f"{measured.elements:,} weights in {format_bytes(measured.bytes)} (packed "
        f"{format_bytes(measured.packed_bytes)} + quant state "
        f"{format_bytes(measured.quant_state_bytes)}); kept as they were: {kept}, embeddings, norms"
    )


def check_checkpoint_base(model: torch.nn.Module, checkpoint: Any) -> None:
    """Before resuming: the checkpoint's 4-bit base (packed codes and quant states) must be the
    one just rebuilt from ``--model``, and every other entry must be there. Accelerate's strict
    load cannot take bitsandbytes' quant-state entries (``Linear4bit`` saves them but does not
    load them), so the run loads non-strictly after this check.

    Raises:
        EffitrainError: a key is missing or extra, or a 4-bit weight differs (another base model).
    """
    from pathlib import Path

    import torch
    from safetensors import safe_open

    expected = model.state_dict()
    found: dict[str, Any] = {}
    for file in sorted(Path(checkpoint).glob("model*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    saved = {expected[key].data_ptr() for key in found if key in expected}
    # A tied weight (the output layer sharing the embeddings) is saved once, under one name.
    missing = [k for k in expected if k not in found and expected[k].data_ptr() not in saved]
    missing += sorted(set(found) - set(expected))
    if missing:
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its model does not match this one ({missing[0]} "
            "is in one of them only); resume with the options it was saved with"
        )
    for key, value in expected.items():
        if ".base_layer.weight" in key and not torch.equal(found[key], value.detach().cpu()):
            raise EffitrainError(
                f"cannot resume from {checkpoint}: its 4-bit base weight {key} differs from the "
                "one quantized from --model now; resume with the base model it was trained on"
            )


SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"
"""Where Accelerate's ``save_state`` writes an FSDP2 model in ``SHARDED_STATE_DICT`` form
(torch.distributed.checkpoint), under the keys ``model.<name>``."""


def check_sharded_checkpoint_base(
    accelerator: Any, model: torch.nn.Module, checkpoint: Any
) -> None:
    """:func:`check_checkpoint_base` for an FSDP2 checkpoint in ``SHARDED_STATE_DICT`` form:
    the same keys, and each rank's shard of every 4-bit weight's packed codes equal to the one
    just quantized from ``--model`` (read by torch.distributed.checkpoint into this rank's
    layout). A collective: every process calls it, and every one raises.

    Raises:
        EffitrainError: as :func:`check_checkpoint_base`.
    """
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp

    from effitrain.memory.ledger import is_4bit

    folder = Path(checkpoint) / SHARDED_MODEL_DIR
    expected = model.state_dict(keep_vars=True)
    found = (
        {
            key.removeprefix("model.")
            for key in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        }
        if folder.is_dir()
        else set()
    )
    odd = sorted(set(expected) ^ found)
    if odd:
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its model does not match this one ({odd[0]} "
            "is in one of them only); resume with the options it was saved with"
        )
    codes = {key: value.detach() for key, value in expected.items() if is_4bit(value)}
    saved = {key: torch.empty_like(value) for key, value in codes.items()}
    dcp.load({"model": saved}, checkpoint_id=str(folder))
    # As bytes: codes stored as bf16 read as floats include NaNs, never equal to themselves.
    differ = [
        key
        for key in codes
        if not torch.equal(
            saved[key].to_local().view(torch.uint8), codes[key].to_local().view(torch.uint8)
        )
    ]
    flag = torch.tensor(float(bool(differ)), device=accelerator.device)
    if float(accelerator.reduce(flag, "sum")) > 0:
        where = differ[0] if differ else "a 4-bit base weight on another process"
        raise EffitrainError(
            f"cannot resume from {checkpoint}: its 4-bit base weight {where} differs from the "
            "one quantized from --model now; resume with the base model it was trained on"
        )
