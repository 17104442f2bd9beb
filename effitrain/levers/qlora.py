"""QLoRA's frozen base: ``--load-in-4bit`` stores the base model's Linear weights in 4-bit NF4
(bitsandbytes), under LoRA's adapters (``--lora-rank``). What is quantized and how, and what it
takes: :mod:`effitrain.levers.qlora_bnb`; a resume's check of the 4-bit base:
:mod:`effitrain.checkpoint.quantized`.

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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.lora import LoRAOptions, adapters_on
from effitrain.levers.qlora_bnb import (
    BLOCKSIZE,
    INSTALL,
    compute_dtype,
    kept_modules,
    mark_sharded_weights,
    no_cpu_repacking,
    quantization_config,
    quantize_model,
    quantized_like,
    require_bitsandbytes,
    shardable_codes,
    storage,
)
from effitrain.levers.spec import Lever, Search
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.models import LoadOptions
    from effitrain.parts import RunParts


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
        return QLoRAOptions.of(config).load_in_4bit

    def check(self, config: TrainConfig) -> None:
        if not adapters_on(config):
            raise EffitrainError(
                "--load-in-4bit needs --lora-rank R: 4-bit weights are frozen, only LoRA "
                "adapters can train over them; add --lora-rank 8"
            )
        if LoRAOptions.of(config).lora_merge:
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

    def after_prepare(self, run: RunParts) -> None:
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
    ) -> torch.nn.Module:
        if getattr(model, "is_loaded_in_4bit", False):  # quantized while it was read
            no_cpu_repacking(model)
            return model
        return quantize_model(model, config, device)

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return describe(model, config)

    def metrics(self, run: RunParts) -> dict[str, Any]:
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

    def check_checkpoint(self, run: RunParts, checkpoint: Path) -> None:
        from effitrain.checkpoint.quantized import (
            check_checkpoint_base,
            check_sharded_checkpoint_base,
        )

        model = run.accelerator.unwrap_model(run.model)
        if run.launch.sharding.kind == "fsdp2":
            check_sharded_checkpoint_base(run.accelerator, model, checkpoint)
        else:
            check_checkpoint_base(model, checkpoint)


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
