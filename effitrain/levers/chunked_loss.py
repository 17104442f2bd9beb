"""``--chunked-loss``: a causal LM's loss computed from the last hidden states chunk by chunk,
never holding the full logits (:mod:`effitrain.tasks.lm_loss`, which also says why ``auto``
keeps the full logits where it must). On by default for causal-LM and preference training
(``auto``); GRPO's log-probs come from the completion's full logits, so it takes none."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.levers.spec import Lever, Search

if TYPE_CHECKING:
    from effitrain.config import TrainConfig
    from effitrain.levers.spec import LossOptions
    from effitrain.parts import RunParts


CHUNKED_LOSS = ("auto", "torch", "liger", "cce", "off")
"""``--chunked-loss`` (effitrain.tasks.lm_loss): auto picks a fused CUDA kernel, else torch."""


@dataclass
class ChunkedLossOptions(OptionGroup):
    """``--chunked-loss``."""

    chunked_loss: str | None = option_field(
        None,
        "causal-lm: compute the loss from the last hidden states chunk by chunk, never holding "
        "the full logits: auto (default: liger-kernel or cut-cross-entropy on CUDA where "
        "installed, else torch), torch, liger, cce, or off.",
        panel=MEMORY_LEVERS,
        choices=CHUNKED_LOSS,
        default_text="auto",
    )


class ChunkedLoss(Lever):
    name = "chunked-loss"
    options = ChunkedLossOptions
    removes = "the full logits and their gradient (tokens x vocabulary, fp32)"
    task = ("causal-lm", "preference")
    search = Search(("off", "auto"), order=30)
    time_cost = "one more output-layer matmul per chunk in backward (recomputed logits)"

    def is_on(self, config: TrainConfig) -> bool:
        return ChunkedLossOptions.of(config).chunked_loss != "off"

    def in_use(self, run: RunParts) -> bool:
        return run.loss.chunked  # auto keeps the full logits where it must

    def loss_options(self, config: TrainConfig, options: LossOptions) -> LossOptions:
        wanted = ChunkedLossOptions.of(config).chunked_loss or "auto"
        return dataclasses.replace(options, chunked=wanted)
