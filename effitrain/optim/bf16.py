"""Pure-bf16 weights (``--weights-dtype bf16``): parameters and gradients in bf16.

Not autocast: Accelerate's ``--mixed-precision bf16`` computes in bf16 but keeps fp32 weights, so
it saves no weight memory. Here the model itself is cast to bf16 after loading, and the optimizer
is replaced by a variant that updates bf16 weights without losing small steps. A plain update
rounds ``w + lr * step`` to the nearest bf16 (8 significant bits), so any step below about
1/256 of the weight vanishes; fine-tuning steps (lr 2e-4) mostly do. Two ways to keep them:

- Kahan summation (torch-optimi): a bf16 compensation buffer carries each rounding error into
  the next step. Deterministic, but one more weight-sized buffer: right for AdamW and SGD, whose
  state is weight-sized anyway.
- Stochastic rounding (:mod:`effitrain.optim.stochastic_rounding`): the update is computed in
  fp32 on one parameter at a time (a large one block by block of rows) and rounded up or down
  at random, exact in expectation. No buffer: right for Adafactor, whose state is near zero (a
  Kahan buffer would be 2 bytes per parameter, more than all of Adafactor's state). The
  rounding is torchao's and pytorch-optimizer's bit trick, with a generator per parameter whose
  state is optimizer state.

===============  ======================================  ========================================
--optim          bf16 variant                            state per parameter
===============  ======================================  ========================================
adamw            optimi.AdamW, kahan_sum                 exp_avg, exp_avg_sq, kahan_comp (bf16:
                                                         6 bytes)
sgd              optimi.SGD, kahan_sum                   exp_avg (momentum), kahan_comp (bf16: 4)
adafactor        torch.optim.Adafactor + stochastic      row_var + col_var (fp32, about
                 rounding                                4(m+n)/(mn)); a generator state per
                                                         tensor (5056 bytes on CPU, 16 on CUDA)
adafactor-hf     transformers' Adafactor + stochastic    exp_avg_sq_row/col (fp32), as above
                 rounding
===============  ======================================  ========================================

The rest have none and are refused (:func:`refusal`): bitsandbytes' 8-bit AdamW rounds bf16
weights to nearest. Not torchao's ``_AdamW(bf16_stochastic_round=True)`` nor ``AdamW8bit``: they
``torch.compile`` every parameter shape on the first step (slow to start on a CPU, see
docs/levers.md) and draw the rounding's random numbers from the global RNG. With
``--lora-rank`` any optimizer is allowed: the trained adapters stay fp32 (the frozen base is
what bf16 halves), and the Adafactors train them as the registry builds them.

The variants reproduce the registry's hyperparameters (torch's AdamW betas and eps, SGD momentum
0.9 without dampening, L2 weight decay for SGD, the Adafactors' own arguments), so a bf16 run
differs from its fp32 twin only in precision. One known loss: optimi applies AdamW's decoupled
weight decay (``w *= 1 - lr * wd``) to the bf16 weight before the compensated step, so at
fine-tuning lr it rounds away (the Adafactors decay the fp32 copy: kept in expectation).
Kahan summation uses no random numbers, and stochastic rounding saves its generators' states
with the optimizer, so checkpoints resume bit-exactly.

Nothing heavy is imported at module level: :mod:`effitrain.levers.bf16_weights` (the lever)
reads :data:`BF16_VARIANTS` before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from effitrain.optim.optimizer_spec import OptimizerSpec, ParamGroups

INSTALL = "pip install 'effitrain[bf16]'  (torch-optimi)"


def _optimi_adamw(groups: ParamGroups, lr: float, seeds: ParamSeeds) -> torch.optim.Optimizer:
    import optimi

    # torch.optim.AdamW's betas and eps (optimi's own defaults are 0.99 and 1e-6).
    return optimi.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, kahan_sum=True)


def _optimi_sgd(groups: ParamGroups, lr: float, seeds: ParamSeeds) -> torch.optim.Optimizer:
    import optimi

    # As torch.optim.SGD(momentum=0.9): no dampening, weight decay as an L2 term in the gradient.
    return optimi.SGD(groups, lr=lr, momentum=0.9, kahan_sum=True)


def _sr_adafactor(groups: ParamGroups, lr: float, seeds: ParamSeeds) -> torch.optim.Optimizer:
    from effitrain.optim.stochastic_rounding import Adafactor

    # As the registry's torch.optim.Adafactor(groups, lr=lr).
    return Adafactor(groups, lr=lr, seeds=seeds.take(groups))


def _sr_adafactor_hf(groups: ParamGroups, lr: float, seeds: ParamSeeds) -> torch.optim.Optimizer:
    from effitrain.optim.stochastic_rounding import AdafactorHF

    # As the registry's (the Trainer's optim="adafactor").
    return AdafactorHF(
        groups,
        lr=lr,
        relative_step=False,
        scale_parameter=False,
        warmup_init=False,
        seeds=seeds.take(groups),
    )


class ParamSeeds:
    """The rounding generators' seeds, one per trained parameter, from the run seed and the
    parameter's position among them (in the order the optimizers take them): a run with
    ``--optimizer-in-backward`` (one optimizer per parameter) seeds each parameter as a run
    without it does, and no two parameters draw the same random stream."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.taken = 0

    def take(self, groups: ParamGroups) -> list[int]:
        """The next seeds, one for each parameter in ``groups``."""
        count = sum(len(group["params"]) for group in groups)
        first, self.taken = self.taken, self.taken + count
        # str seeds go through SHA-512: well mixed, and the same in every process.
        return [
            random.Random(f"{self.seed}:{i}").getrandbits(63) for i in range(first, first + count)
        ]


@dataclass(frozen=True)
class Bf16Variant:
    """The class that updates bf16 weights correctly in place of a registry optimizer."""

    class_path: str
    rule: str
    """The update rule, for the banner."""
    state: str
    factory: Callable[[ParamGroups, float, ParamSeeds], torch.optim.Optimizer]
    module: str = "optimi"
    install: str = INSTALL
    over_lora: bool = True
    """Also built over LoRA's fp32 adapters (optimi's update is the same there); False: nothing
    to round on fp32 adapters, the registry's optimizer trains them."""
    in_bf16: str = "parameters, gradients, optimizer state"
    """What is bf16, for the banner."""


_SR_STATE = "; rounding_generator (uint8, on the host)"
_SR_IN_BF16 = "parameters, gradients; the factored state fp32"

BF16_VARIANTS: dict[str, Bf16Variant] = {
    "adamw": Bf16Variant(
        "optimi.AdamW",
        "AdamW with Kahan summation (torch-optimi)",
        "exp_avg, exp_avg_sq, kahan_comp (bf16)",
        _optimi_adamw,
    ),
    "sgd": Bf16Variant(
        "optimi.SGD",
        "SGD with momentum and Kahan summation (torch-optimi)",
        "exp_avg (momentum), kahan_comp (bf16)",
        _optimi_sgd,
    ),
    "adafactor": Bf16Variant(
        "torch.optim.Adafactor + stochastic rounding",
        "torch.optim.Adafactor in fp32 per parameter (the largest by blocks of rows), "
        "stochastic rounding to bf16",
        "step, row_var + col_var (>=2-D), variance (1-D) (fp32)" + _SR_STATE,
        _sr_adafactor,
        module="torch",
        install="pip install 'torch>=2.5'",
        over_lora=False,
        in_bf16=_SR_IN_BF16,
    ),
    "adafactor-hf": Bf16Variant(
        "transformers.optimization.Adafactor + stochastic rounding",
        "transformers' Adafactor in fp32 per parameter (the largest by blocks of rows), "
        "stochastic rounding to bf16",
        "step, exp_avg_sq_row/col (>=2-D) or exp_avg_sq, RMS (fp32)" + _SR_STATE,
        _sr_adafactor_hf,
        module="transformers",
        install="pip install transformers",
        over_lora=False,
        in_bf16=_SR_IN_BF16,
    ),
}

NONE_BECAUSE = {
    "adamw-8bit": "bitsandbytes rounds bf16 weights to nearest",
}
"""Why an optimizer has no bf16 variant, where there is more to say than that it has none."""


def variant_for(optim: str, adapters: bool) -> Bf16Variant | None:
    """The bf16 variant a run with bf16 weights builds for ``optim``, or None (no variant; or
    LoRA ``adapters`` that stay fp32 and that the registry's optimizer trains)."""
    variant = BF16_VARIANTS.get(optim)
    if variant is not None and adapters and not variant.over_lora:
        return None
    return variant


def variant_spec(spec: OptimizerSpec, variant: Bf16Variant, seed: int) -> OptimizerSpec:
    """The registry's ``spec`` with ``variant`` in its place: same name, lr and defaults;
    another class, state and factory (its rounding generators seeded from ``seed``)."""
    return dataclasses.replace(
        spec,
        class_path=variant.class_path,
        module=variant.module,
        install=variant.install,
        state=variant.state,
        factory=functools.partial(variant.factory, seeds=ParamSeeds(seed)),
    )


def cast_model(model: Any) -> Any:
    """Cast the model's floating-point parameters and buffers to bf16 (integer buffers such as
    position ids keep their dtype). Done before LoRA wraps the model, so its adapters stay fp32."""
    import torch

    return model.to(torch.bfloat16)


def keep_trained_fp32(model: Any) -> None:
    """With LoRA over bf16 base weights: the modules that train in full (the head that peft
    copies, BERT's pooler) go back to fp32, like the adapters, and cast their inputs (the base
    model's bf16 hidden states) to fp32. Every trained parameter is then fp32, so any optimizer
    updates it without losing small steps, and the logits and the loss are fp32."""
    import torch

    def to_fp32(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        )

    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if any(p.requires_grad and p.dtype == torch.bfloat16 for p in own):
            module.float()
            module.register_forward_pre_hook(to_fp32)
