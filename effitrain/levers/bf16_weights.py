"""``--weights-dtype bf16``: the weights (and gradients, and the optimizer state where it can)
in bf16, updated by an optimizer variant that keeps small steps (Kahan summation or stochastic
rounding, :mod:`effitrain.optim.bf16`). Not autocast: that is ``--mixed-precision``.

A checkpoint is read straight into bf16 (``from_pretrained(dtype=torch.bfloat16)``, each
tensor cast as it is read) and a preset is built in bf16: no fp32 copy of the model exists.
The cast after loading remains for what transformers leaves in fp32 (rotary ``inv_freq``
buffers, a model's ``_keep_in_fp32_modules``); for the rest it changes nothing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.lora import adapters_on
from effitrain.levers.spec import Lever, Search

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.models import LoadOptions
    from effitrain.optim import OptimizerSpec


WEIGHTS_DTYPES = ("fp32", "bf16")


@dataclass
class Bf16WeightsOptions(OptionGroup):
    """``--weights-dtype``."""

    weights_dtype: str = option_field(
        "fp32",
        "fp32 or bf16: keep the weights (and gradients, and the optimizer state where it can) "
        "in this dtype. Not autocast: see --mixed-precision.",
        panel=MEMORY_LEVERS,
        choices=WEIGHTS_DTYPES,
    )


class Bf16Weights(Lever):
    name = "bf16-weights"
    options = Bf16WeightsOptions
    removes = "half of the parameters, the gradients and the state"
    search = Search(("fp32", "bf16"), order=20, costs_time=False)
    time_cost = "faster matmuls on GPUs with bf16 units; the update adds a rounding step"

    def is_on(self, config: TrainConfig) -> bool:
        return Bf16WeightsOptions.of(config).weights_dtype == "bf16"

    def check(self, config: TrainConfig) -> None:
        from effitrain.optim.bf16 import BF16_VARIANTS, NONE_BECAUSE

        if config.mixed_precision == "fp16":
            raise EffitrainError(
                "--weights-dtype bf16 cannot run under --mixed-precision fp16 (fp16 autocast "
                "would squeeze bf16 weights into fp16's range and scale bf16 gradients); drop "
                "--mixed-precision or use --mixed-precision bf16 with --weights-dtype fp32"
            )
        # Only the dtype of the trained parameters matters: with LoRA they are fp32 adapters.
        if config.optim not in BF16_VARIANTS and not adapters_on(config):
            why = NONE_BECAUSE.get(config.optim, "it has no bf16 variant")
            raise EffitrainError(
                "--weights-dtype bf16 needs an optimizer that updates bf16 weights without "
                "losing small steps (Kahan summation or stochastic rounding): "
                f"{', '.join(BF16_VARIANTS)}; --optim {config.optim}: {why}; use "
                "--weights-dtype fp32, or --lora-rank (its adapters stay fp32)"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if launch.sharding.sharded:
            # Refused, not left unverified: both bring their own low-precision parameters, and
            # optimi's Kahan buffers are not sharding-aware.
            raise EffitrainError(
                f"--weights-dtype bf16 is not supported under {launch.sharding.description}: "
                "use its own bf16 (FSDP's mixed-precision policy, DeepSpeed's bf16 section) "
                "with --weights-dtype fp32"
            )

    def optimizer_spec(self, spec: OptimizerSpec, config: TrainConfig) -> OptimizerSpec:
        from effitrain.optim.bf16 import variant_for, variant_spec

        variant = variant_for(config.optim, adapters=adapters_on(config))
        return spec if variant is None else variant_spec(spec, variant, config.seed)

    def load_options(self, config: TrainConfig, options: LoadOptions) -> LoadOptions:
        return dataclasses.replace(options, dtype="bfloat16")

    def apply_to_model(
        self, model: torch.nn.Module, config: TrainConfig, device: torch.device | None
    ) -> torch.nn.Module:
        import torch

        from effitrain.optim import get_spec
        from effitrain.optim.bf16 import cast_model

        spec = self.optimizer_spec(get_spec(config.optim), config)
        if not spec.is_available():
            raise EffitrainError(
                f"--weights-dtype bf16 with --optim {spec.name} needs {spec.class_path} from the "
                f"'{spec.module}' package, which is not installed: {spec.install}"
            )
        if getattr(model, "is_quantized", False):
            # transformers refuses .to(dtype) on a model it quantized while loading; torch's own
            # Module.to casts floating-point tensors only: the 4-bit codes stay as they are.
            return torch.nn.Module.to(model, torch.bfloat16)
        return cast_model(model)

    def finish_model(self, model: torch.nn.Module, config: TrainConfig) -> None:
        from effitrain.models import is_lora
        from effitrain.optim.bf16 import keep_trained_fp32

        if is_lora(model):  # what trains in full beside the adapters goes back to fp32 too
            keep_trained_fp32(model)

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        from effitrain.optim.bf16 import variant_for

        variant = variant_for(config.optim, adapters=adapters_on(config))
        if variant is None:
            return (
                "weights bf16 (parameters, gradients, optimizer state), "
                f"{config.optim} on fp32 LoRA adapters"
            )
        return f"weights bf16 ({variant.in_bf16}), {variant.rule}"
