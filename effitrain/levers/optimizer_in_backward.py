"""``--optimizer-in-backward``: each parameter is updated as soon as its gradient is ready, and
that gradient freed, so the full set of gradients never exists (torchtune's
``optimizer_in_bwd``): one optimizer per parameter, stepped from a post-accumulate-grad hook
(:class:`effitrain.optim.in_backward.InBackwardOptimizer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.spec import Lever, OptimizerBuilder, Search
from effitrain.memory.ledger import unwrap_prepared

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.parts import RunParts


@dataclass
class OptimizerInBackwardOptions(OptionGroup):
    """``--optimizer-in-backward``."""

    optimizer_in_backward: bool = option_field(
        False,
        "Update each parameter as soon as its gradient is ready and free that gradient, so the "
        "full set of gradients never exists.",
        panel=MEMORY_LEVERS,
    )


class OptimizerInBackward(Lever):
    name = "optimizer-in-backward"
    options = OptimizerInBackwardOptions
    removes = "the full set of gradients (one parameter's at a time)"
    in_backward = "update"
    search = Search((False, True), order=10, costs_time=False, removes_only_update=True)
    time_cost = "none measurable: the same updates, one parameter at a time"

    def is_on(self, config: TrainConfig) -> bool:
        return OptimizerInBackwardOptions.of(config).optimizer_in_backward

    def check(self, config: TrainConfig) -> None:
        if config.max_grad_norm is not None and config.max_grad_norm > 0:
            raise EffitrainError(
                f"--max-grad-norm {config.max_grad_norm:g} clips the global gradient norm, "
                "which needs every gradient at once, but --optimizer-in-backward updates each "
                "parameter as soon as its own is ready; use --max-grad-norm 0 (or leave it out)"
            )
        if config.grad_accum > 1:
            raise EffitrainError(
                f"--grad-accum {config.grad_accum} cannot combine with --optimizer-in-backward, "
                "which updates each parameter in every backward pass (after every "
                "micro-batch); use --grad-accum 1 and a larger --batch-size"
            )
        if config.mixed_precision == "fp16":
            raise EffitrainError(
                "--mixed-precision fp16 cannot combine with --optimizer-in-backward: its loss "
                "scaler must see every gradient before any update (to unscale them and skip "
                "steps that overflow); use --mixed-precision bf16 or no"
            )
        refuse_unless_per_parameter(
            config,
            "--optimizer-in-backward",
            "it is built over the whole model, not one parameter at a time",
        )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if not launch.single_process:
            # The update runs in a post-accumulate-grad hook, which fires before DDP's
            # all-reduce (it would use this process's gradient alone); FSDP and DeepSpeed own
            # the gradients.
            raise EffitrainError(
                f"--optimizer-in-backward cannot run on {launch.sharding.description}: each "
                "update runs as soon as this process's gradient is ready, before the processes "
                "average their gradients; run one process, or drop --optimizer-in-backward"
            )

    def optimizer_builder(self, config: TrainConfig, estimating: bool) -> OptimizerBuilder:
        def build(groups: Any, spec: Any, lr: float) -> Any:
            from effitrain.optim.in_backward import InBackwardOptimizer

            return InBackwardOptimizer(groups, spec.factory, lr)

        return build

    def after_prepare(self, run: RunParts) -> None:
        from effitrain.optim.in_backward import InBackwardOptimizer

        optimizer = unwrap_prepared(run.optimizer)
        assert isinstance(optimizer, InBackwardOptimizer)  # this lever built it
        optimizer.check_hooked(run.accelerator.unwrap_model(run.model))

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return (
            "optimizer step in backward: each parameter is updated as soon as its gradient is "
            "ready, then the gradient is freed (no clipping)"
        )


def refuse_unless_per_parameter(config: TrainConfig, flag: str, whole_model: str) -> None:
    """A lever that runs one optimizer per parameter: refuse the optimizers that cannot be one
    (``whole_model`` says why for those built over the whole model).

    Raises:
        EffitrainError: naming the optimizer, the lever and why.
    """
    from effitrain.optim import IN_BACKWARD_REFUSED, get_spec

    why = IN_BACKWARD_REFUSED.get(config.optim)
    if not get_spec(config.optim).per_parameter:
        why = whole_model
    if why:
        raise EffitrainError(
            f"--optim {config.optim} cannot combine with {flag}: {why}; use another --optim or "
            "leave the lever out"
        )
