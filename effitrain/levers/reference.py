"""The reference model (DPO's, and GRPO's KL penalty's) as a memory lever: ``--reference
adapters|precompute|copy`` and ``--reference-dtype``, what they resolve to (:func:`how`,
:func:`copy_dtype`), their checks, and what the reference shows (the banner line, the metrics
JSON's ``reference``, its memory table row, the estimate's note) and checks before a resume.

The reference itself (its providers, the precomputed table kept in checkpoints, the frozen copy)
belongs to the loss, which builds it once the run is prepared:
:mod:`effitrain.tasks.reference_model`. The lever is on whenever the run trains with ``--task
preference --preference-loss dpo`` or ``--task grpo --beta`` above 0; ORPO, SimPO and GRPO with
``--beta`` 0 need no reference, and ``--reference`` with them is refused, as ``precompute`` is
under GRPO (its completions are generated during training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.errors import EffitrainError
from effitrain.levers.bf16_weights import Bf16WeightsOptions
from effitrain.levers.lora import adapters_on
from effitrain.levers.spec import Lever
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.parts import RunParts

TABLE_FILE = "reference_logps.safetensors"
"""The precomputed table's file in a checkpoint folder."""
COPY_SHARDINGS = ("fsdp1", "fsdp2", "deepspeed")
"""The shardings a copy is refused under: its weights would be whole on every process."""
REFERENCES = ("adapters", "precompute", "copy")
"""``--reference``: how the reference's log-probs are paid for."""
REFERENCE_DTYPES = ("fp32", "bf16", "4bit")


@dataclass
class ReferenceOptions(OptionGroup):
    """``--reference``, ``--reference-dtype``."""

    reference: str | None = option_field(
        None,
        "preference (dpo), grpo (--beta above 0): the reference model's log-probs from the "
        "base with the adapters switched off (no second copy; with --lora-rank), precomputed "
        "in one pass before training (dpo only; kept with checkpoints), or a frozen copy in "
        "the step.",
        panel=MEMORY_LEVERS,
        metavar="HOW",
        choices=REFERENCES,
        default_text="adapters with --lora-rank, else precompute (dpo) or copy (grpo)",
    )
    reference_dtype: str | None = option_field(
        None,
        "preference, grpo, --reference copy: the copy's weights: fp32, bf16 or 4bit "
        "(bitsandbytes NF4).",
        panel=MEMORY_LEVERS,
        metavar="DTYPE",
        choices=REFERENCE_DTYPES,
        default_text="as the trained weights",
    )


def how(config: TrainConfig) -> str:
    """``--reference`` as used: the given one, else adapters with --lora-rank, else precompute
    (GRPO: a copy; its completions are generated during training)."""
    given = ReferenceOptions.of(config).reference
    if given is not None:
        return given
    if adapters_on(config):
        return "adapters"
    return "copy" if config.task == "grpo" else "precompute"


def copy_dtype(config: TrainConfig) -> str:
    """The copy's weights: ``--reference-dtype``, else the trained weights' (fp32 or bf16)."""
    given = ReferenceOptions.of(config).reference_dtype
    if given is not None:
        return given
    return "bf16" if Bf16WeightsOptions.of(config).weights_dtype == "bf16" else "fp32"


def _instead(config: TrainConfig) -> str:
    """The reference to suggest where a copy cannot serve (GRPO cannot precompute)."""
    if config.task == "grpo":
        return "--lora-rank R (the adapters-off reference)"
    return "--reference precompute"


class ShownReference(Protocol):
    """What the lever shows of a reference (``tasks.reference_model.Provider``)."""

    @property
    def dtype(self) -> str | None: ...

    def bytes(self) -> int: ...


@runtime_checkable
class HoldsReference(Protocol):
    """The loss that holds the reference (``tasks.preference_loss.PreferenceLoss``,
    ``tasks.grpo_loss.GrpoLoss``, a layer above the levers: named here by its shape)."""

    @property
    def reference(self) -> ShownReference | None: ...


class Reference(Lever):
    name = "reference"
    options = ReferenceOptions
    removes = (
        "the second model a DPO or GRPO reference would hold (adapters, precompute), or part "
        "of it (a bf16 or 4-bit copy)"
    )
    task = ("preference", "grpo")
    time_cost = (
        "adapters and copy: one no-grad forward per micro-batch; precompute: one no-grad pass "
        "over the data before training"
    )

    def is_on(self, config: TrainConfig) -> bool:
        if config.task == "grpo":
            return (config.beta or 0.0) > 0
        return config.task == "preference" and config.preference_loss == "dpo"

    def check(self, config: TrainConfig) -> None:
        options = ReferenceOptions.of(config)
        given = "--reference" if options.reference is not None else "--reference-dtype"
        if config.task == "grpo" and not self.is_on(config):
            raise EffitrainError(
                f"{given} needs --beta above 0 under --task grpo (--beta 0 uses no reference "
                f"model); drop {given}"
            )
        if config.preference_loss != "dpo" and options.reference is not None:
            raise EffitrainError(
                f"--reference needs --preference-loss dpo ({config.preference_loss} uses no "
                "reference model); drop --reference"
            )
        if config.task == "grpo" and options.reference == "precompute":
            raise EffitrainError(
                "--reference precompute cannot serve --task grpo: its completions are generated "
                "during training, after any pass before it; use --reference copy, or adapters "
                "with --lora-rank"
            )
        if ReferenceOptions.of(config).reference_dtype is not None and how(config) != "copy":
            raise EffitrainError(
                f"--reference-dtype needs --reference copy (this run's reference is "
                f"{how(config)}); add --reference copy, or drop --reference-dtype"
            )
        if ReferenceOptions.of(config).reference == "copy" and adapters_on(config):
            # The frozen base under the adapters already is the reference, at no cost.
            raise EffitrainError(
                "--reference copy with --lora-rank would hold a second copy of the frozen base, "
                "which the adapters-off forward gives for 0 bytes; use --reference adapters"
            )
        if ReferenceOptions.of(config).reference == "adapters" and not adapters_on(config):
            raise EffitrainError(
                "--reference adapters needs --lora-rank R (the base with the adapters switched "
                "off is the reference); add --lora-rank 8, or use --reference "
                + ("copy" if config.task == "grpo" else "precompute")
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if how(config) == "copy" and launch.sharding.kind in COPY_SHARDINGS:
            raise EffitrainError(
                f"--reference copy is not supported under {launch.sharding.description}: the "
                f"copy's weights would be whole on every process; use {_instead(config)}"
            )
        if how(config) == "copy" and copy_dtype(config) == "4bit":
            from effitrain.levers.qlora_bnb import require_bitsandbytes

            require_bitsandbytes()

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return {
            "adapters": "reference: the base with the adapters switched off (no second copy)",
            "precompute": "reference: log-probs precomputed in one pass before training, kept "
            "with checkpoints",
            "copy": f"reference: a frozen {copy_dtype(config)} copy of the model, in the step",
        }[how(config)]

    def metrics(self, run: RunParts) -> dict[str, Any]:
        loss = run.loss
        assert isinstance(loss, HoldsReference) and loss.reference is not None  # DPO's, GRPO's
        provider = loss.reference
        return {
            "reference": {
                "how": how(run.config),
                "dtype": provider.dtype,
                "bytes": provider.bytes(),
            }
        }

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        reference = metrics.get("reference")
        if not reference:
            return []
        label = {
            "adapters": "  + reference: adapters switched off (no copy)",
            "precompute": "  + reference: precomputed log-probs (at peak: in other)",
            "copy": f"  + reference: frozen {reference['dtype']} copy",
        }[reference["how"]]
        # The step probe tracks the copy's weights (as parameters) and the table (as other):
        # both exist before the step and live through it, so all of them are in its peak.
        at_peak = reference["bytes"] if step is not None else None
        return [MemoryRow(label, reference["bytes"], part_of="parameters", at_peak=at_peak)]

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        return {
            "adapters": ["reference: the adapters-off forward runs in the estimated step"],
            "precompute": [
                "reference: the precomputed table's bytes are counted (the pass before training "
                "is not run: it frees what it holds before the first step)"
            ],
            "copy": [f"reference: the frozen {copy_dtype(config)} copy's weights are in the peak"],
        }[how(config)]

    def check_checkpoint(self, run: RunParts, checkpoint: Path) -> None:
        if how(run.config) == "precompute" and not (checkpoint / TABLE_FILE).is_file():
            raise EffitrainError(
                f"cannot resume from {checkpoint}: it holds no precomputed reference log-probs "
                f"({TABLE_FILE}); it was not written by a --reference precompute run"
            )
