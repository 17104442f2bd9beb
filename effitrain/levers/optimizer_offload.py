"""``--optimizer-offload state|state+grads``: the optimizer state and its step live on the host
(torchao's ``CPUOffloadOptimizer``, wrapped by :class:`effitrain.optim.offload.OffloadedOptimizer`);
with ``state+grads`` each gradient is also freed on the GPU once copied. CUDA only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.optimizer_in_backward import (
    OptimizerInBackwardOptions,
    refuse_unless_per_parameter,
)
from effitrain.levers.spec import Lever, OptimizerBuilder, Search
from effitrain.memory.ledger import unwrap_prepared
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.parts import RunParts


OPTIMIZER_OFFLOAD = ("off", "state", "state+grads")
"""``--optimizer-offload``: nothing, the optimizer state and step, or also the gradients."""


@dataclass
class OptimizerOffloadOptions(OptionGroup):
    """``--optimizer-offload``."""

    optimizer_offload: str = option_field(
        "off",
        "CUDA: off, state (the optimizer state and its step on the host, torchao's "
        "CPUOffloadOptimizer) or state+grads (also each gradient, once backward made it).",
        panel=MEMORY_LEVERS,
        choices=OPTIMIZER_OFFLOAD,
    )


def offloads_gradients(config: TrainConfig) -> bool:
    """``--optimizer-offload state+grads``: each gradient goes to the host too."""
    return OptimizerOffloadOptions.of(config).optimizer_offload == "state+grads"


class OptimizerOffload(Lever):
    name = "optimizer-offload"
    options = OptimizerOffloadOptions
    removes = "the optimizer state from the GPU (state+grads: the gradients too)"
    packages = ("torchao",)
    install = "pip install 'effitrain[offload]'"
    in_backward = "gradients"
    devices = ("cuda",)
    search = Search(
        ("off", "state", "state+grads"),
        order=70,
        removes_only_update=True,
        steps_when_on=True,
    )
    time_cost = "the step runs on the host: host bandwidth and CPU speed bound it"

    def is_on(self, config: TrainConfig) -> bool:
        return OptimizerOffloadOptions.of(config).optimizer_offload != "off"

    def check(self, config: TrainConfig) -> None:
        if OptimizerInBackwardOptions.of(config).optimizer_in_backward:
            raise EffitrainError(
                "--optimizer-offload cannot combine with --optimizer-in-backward: both run the "
                "update from a hook on each gradient; choose one"
            )
        if config.max_grad_norm is not None and config.max_grad_norm > 0:
            raise EffitrainError(
                f"--max-grad-norm {config.max_grad_norm:g} cannot combine with "
                "--optimizer-offload: each gradient is copied to the host inside backward, "
                "before clipping could scale it; use --max-grad-norm 0 (or leave it out)"
            )
        if config.mixed_precision == "fp16":
            raise EffitrainError(
                "--mixed-precision fp16 cannot combine with --optimizer-offload: the host "
                "copies of the gradients are made before the loss scaler unscales them; use "
                "--mixed-precision bf16 or no"
            )
        if offloads_gradients(config) and config.grad_accum > 1:
            raise EffitrainError(
                f"--grad-accum {config.grad_accum} cannot combine with --optimizer-offload "
                "state+grads, which frees each gradient on the GPU after every backward pass; "
                "use --optimizer-offload state, or --grad-accum 1 and a larger --batch-size"
            )
        # torchao's offload runs one optimizer per parameter too, with the same limits.
        refuse_unless_per_parameter(
            config,
            "--optimizer-offload",
            "it is built over the whole model, and the offload runs one per parameter",
        )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if launch.device_type != "cuda":
            raise EffitrainError(
                "--optimizer-offload moves the optimizer state from the GPU to host memory; "
                f"this run's device is {launch.device_words}: drop --optimizer-offload"
            )
        if not launch.single_process:
            # torchao copies each gradient in a post-accumulate-grad hook, before DDP's
            # all-reduce (it would step on this process's gradient alone); FSDP and DeepSpeed
            # own the state.
            raise EffitrainError(
                f"--optimizer-offload cannot run on {launch.sharding.description}: each "
                "gradient is copied to the host before the processes average them; run one "
                "process (or use FSDP's or DeepSpeed's own CPU offload)"
            )

    def optimizer_builder(self, config: TrainConfig, estimating: bool) -> OptimizerBuilder:
        gradients = offloads_gradients(config)

        def build(groups: Any, spec: Any, lr: float) -> Any:
            if estimating:  # torchao needs a CUDA device: its stand-in on fake tensors
                from effitrain.optim.offload import EstimatedOffload

                return EstimatedOffload(groups, spec.factory, lr, gradients)
            from effitrain.optim.offload import OffloadedOptimizer

            return OffloadedOptimizer(
                groups,
                spec.factory,
                lr,
                offload_gradients=gradients,
                torch_adamw=spec.class_path == "torch.optim.AdamW",
            )

        return build

    def finish_steps(self, run: RunParts) -> None:
        from effitrain.optim.offload import EstimatedOffload

        optimizer = unwrap_prepared(run.optimizer)
        if isinstance(optimizer, EstimatedOffload):
            optimizer.step_host_optimizers()

    def step_cost(self, run: RunParts, micro_batches: int) -> dict[str, int]:
        from effitrain.optim.offload import offloaded_parameters

        offloaded = offloaded_parameters(run.optimizer)
        # Each backward copies the gradients to the host; the step copies the parameters back.
        moved = sum(p.numel() * p.element_size() for p in offloaded) * (micro_batches + 1)
        return {
            "offload_bytes_per_step": moved,
            "host_step_elements": sum(p.numel() for p in offloaded),
        }

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        grads = ", and each gradient once copied" if offloads_gradients(config) else ""
        return (
            "optimizer offload: state and step on the host for tensors of 4096+ elements "
            f"(torchao's CPUOffloadOptimizer{grads}); no clipping"
        )

    def metrics(self, run: RunParts) -> dict[str, Any]:
        from effitrain.optim.offload import offload_ledger

        return {"optimizer_offload": offload_ledger(run.optimizer)}

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        where = metrics.get("optimizer_offload") or {}
        if not where:
            return []
        return [
            MemoryRow(
                "optimizer state on the GPU (tensors < 4096 elements)", where["device_state_bytes"]
            ),
            MemoryRow("optimizer state on the host", where["host_state_bytes"]),
            MemoryRow("host copies of parameters and gradients", where["host_copy_bytes"]),
        ]

    def host_step_bytes(self, fields: dict[str, Any]) -> int:
        where = fields.get("optimizer_offload") or {}
        return where.get("host_state_bytes", 0) + where.get("host_copy_bytes", 0)

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        return [
            "--optimizer-offload: the host optimizers run on fake copies after the measured "
            "step (their state and copies are host memory, not in the peak)"
        ]
