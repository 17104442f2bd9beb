"""``--chunked-loss``: a causal LM's loss computed from the last hidden states chunk by chunk,
never holding the full logits (:mod:`effitrain.tasks.lm_loss`, which also says why ``auto``
keeps the full logits where it must). On by default for causal-LM training (``auto``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.levers.spec import BuiltRun, Lever, Search

if TYPE_CHECKING:
    from effitrain.config import TrainConfig


class ChunkedLoss(Lever):
    name = "chunked-loss"
    fields = ("chunked_loss",)
    removes = "the full logits and their gradient (tokens x vocabulary, fp32)"
    task = ("causal-lm", "preference")
    search = Search(("off", "auto"), order=30)
    time_cost = "one more output-layer matmul per chunk in backward (recomputed logits)"

    def is_on(self, config: TrainConfig) -> bool:
        return config.chunked_loss != "off"

    def in_use(self, run: BuiltRun) -> bool:
        return self.name in getattr(run.loss, "levers", [])

    def loss_options(self, config: TrainConfig) -> dict[str, Any]:
        return {"chunked": config.chunked_loss or "auto"}
