"""Preference tuning (``--task preference``): a ``*ForCausalLM`` trained on pairs of a chosen and
a rejected answer with DPO, ORPO or SimPO (the losses and the evaluation are
:mod:`.preference_loss`, DPO's reference :mod:`.reference_model`; the data pipeline is
:mod:`.preference_data`).

The model, its loading and the chunked loss's choice of implementation are the causal LM's; the
data is pairs, never packed, and every batch holds each pair as two sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.config import default_for, option
from effitrain.errors import EffitrainError
from effitrain.optim import LrDivisor
from effitrain.tasks.base import CAUSAL_LM_OPTIONS, PREFERENCE
from effitrain.tasks.causal_lm import DecoderTask
from effitrain.tasks.preference_data import (
    FORMATS,
    PreferenceData,
    build_preference_dataloaders,
    load_preference_data,
)

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from effitrain.config import TrainConfig
    from effitrain.levers.spec import LossOptions
    from effitrain.parts import RunParts
    from effitrain.tasks.preference_loss import PreferenceLoss

REFUSED_OPTIONS = CAUSAL_LM_OPTIONS
"""Causal-LM options that preference pairs do not take: they are never packed, the loss is on
the answers by construction, and evaluation reports rewards, not a sample."""
MAX_BETA = 1000.0
"""The largest ``--beta``: far above any published setting (DPO 0.01-0.5, SimPO 2-10)."""


class PreferenceTask(DecoderTask):
    """Preference tuning: ``*ForCausalLM``, pairs of answers, rewards and reward accuracy."""

    name = PREFERENCE
    lr_divisor = LrDivisor(40, "preference tuning")
    """The fine-tuning (or LoRA) lr over 40: AdamW 5e-6 (TRL's DPO default is 1e-6). At AdamW's
    2e-4 SmolLM2-135M's log-prob margin ran to +186 nats with an eval loss of 0.0000 in 36 steps;
    at 5e-6 it learned the same pairs (every validation pair preferred) at +34
    (benchmarks/preference)."""

    def check_options(self, config: TrainConfig) -> None:
        given = [option(name) for name in REFUSED_OPTIONS if getattr(config, name) is not None]
        if given:
            raise EffitrainError(
                f"{given[0]} needs --task causal-lm (this run is {self.name}); drop it"
            )
        if config.max_length < 2:
            raise EffitrainError(
                f"--max-length {config.max_length} leaves no answer token to score: a sequence "
                "needs 2 tokens or more; raise --max-length"
            )
        # Each loss's own option, refused under the others (it would change nothing).
        for name, loss in (("label_smoothing", "dpo"), ("simpo_gamma", "simpo")):
            if config.preference_loss != loss and getattr(config, name) != default_for(name):
                raise EffitrainError(
                    f"{option(name)} is for --preference-loss {loss} (this run is "
                    f"{config.preference_loss}); drop it"
                )
        if not 0 <= config.label_smoothing < 0.5:
            raise EffitrainError(
                f"--label-smoothing must be from 0 to below 0.5 (got {config.label_smoothing})"
            )
        if config.beta is not None and not 0 < config.beta <= MAX_BETA:
            # past this the loss is a step function of the log-probs, and overflows float32
            # long before 1e308: refused here rather than as a non-finite loss blamed on --lr
            raise EffitrainError(
                f"--beta must be greater than 0 and at most {MAX_BETA:g} (got {config.beta:g}); "
                "the defaults are 0.1 (dpo, orpo) and 2 (simpo)"
            )

    def load_data(self, config: TrainConfig) -> PreferenceData:
        return load_preference_data(config)

    def estimate_reads_data(self, config: TrainConfig) -> bool:
        from effitrain.levers.reference import how

        # DPO's precomputed reference counts a table row per example.
        return config.preference_loss == "dpo" and how(config) == "precompute"

    def dataloaders(
        self,
        config: TrainConfig,
        data: PreferenceData,
        tokenizer: Any,
        pad_to_multiple_of: int | None,
    ) -> tuple[DataLoader[Any], DataLoader[Any]]:
        return build_preference_dataloaders(data, tokenizer, config, pad_to_multiple_of)

    def loss_function(
        self,
        model: torch.nn.Module,
        device: torch.device,
        sharded: str | None,
        options: LossOptions,
        *,
        config: TrainConfig,
    ) -> PreferenceLoss:
        from effitrain.tasks.preference_loss import PreferenceLoss

        return PreferenceLoss(config, self.loss_choice(model, device, sharded, options), model)

    def evaluate(self, run: RunParts) -> dict[str, Any]:
        from effitrain.tasks.preference_loss import evaluate_preference

        return evaluate_preference(run)

    def data_line(self, data: PreferenceData, train_loader: Any) -> str:
        # The banner says the pair counts just before: the format and the layout, not again.
        return (
            f"preference pairs ({FORMATS[data.format]}), each a chosen and a rejected sequence, "
            "loss on the answers"
        )

    def fake_batch(
        self, tokenizer: Any, batch_size: int, length: int, packed: bool = False
    ) -> dict[str, Any]:
        """A preference batch of ``batch_size`` pairs: 2 x batch_size rows of ``length`` tokens
        (chosen rows, then rejected), example ids 0..batch_size-1."""
        import torch

        from effitrain.tasks.lm_data import IGNORE_INDEX

        batch = super().fake_batch(tokenizer, 2 * batch_size, length)
        labels = batch["input_ids"].clone()
        # The answer is the second half of each row, the prompt the first: a typical pair, and
        # what the loss's cost depends on (it scores the labelled tokens only).
        labels[:, : length // 2] = IGNORE_INDEX
        batch["labels"] = labels
        batch["example"] = torch.arange(batch_size, dtype=torch.long)
        return batch
