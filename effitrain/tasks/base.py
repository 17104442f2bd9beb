"""What a task is: the part of a run that differs between sequence classification and causal-LM
training (the data pipeline, the model class, the loss, the evaluation, and the words the banner
uses for them). Everything else (optimizers, levers, the loop, memory) is the same for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from effitrain.config import TrainConfig
    from effitrain.levers.spec import LossOptions
    from effitrain.models import LoadOptions
    from effitrain.optim import LrDivisor
    from effitrain.parts import Loss, RunParts
    from effitrain.report.live import Reporter

SEQUENCE_CLASSIFICATION, CAUSAL_LM = "sequence-classification", "causal-lm"
PREFERENCE, GRPO = "preference", "grpo"
TASK_NAMES = (SEQUENCE_CLASSIFICATION, CAUSAL_LM, PREFERENCE, GRPO)
CAUSAL_LM_OPTIONS = ("packing", "completion_only_loss", "sample_prompt")
PREFERENCE_OPTIONS = ("preference_loss", "beta", "label_smoothing", "simpo_gamma")
"""Config fields that only preference training takes (the reference lever's: its spec's
``task``); GRPO takes ``beta`` too (its KL penalty's)."""
"""Config fields that only causal-LM training takes (a lever's: its spec's ``task``)."""
GRPO_OPTIONS = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "reward",
    "reward_weights",
    "grpo_loss",
    "scale_rewards",
    "epsilon",
    "epsilon_high",
    "num_iterations",
)
"""Config fields that only GRPO takes."""


class LossMoments:
    """A loss's moments of the run besides computing the loss (:class:`effitrain.parts.Loss`
    says what each is for), each doing nothing: what a loss that holds nothing besides the model does at them."""

    generates = False

    def after_prepare(self, run: RunParts) -> None:
        pass

    def before_training(self, run: RunParts, reporter: Reporter) -> None:
        pass

    def step_tensors(self) -> list[torch.nn.Module | torch.Tensor]:
        return []

    def step_batches(
        self,
        run: RunParts,
        batches: list[dict[str, Any]],
        generating: Callable[[], AbstractContextManager[None]],
    ) -> Iterator[list[dict[str, Any]]]:
        yield batches

    def histories(self) -> dict[str, list[float]]:
        return {}

    def save_extra(self, run: RunParts, folder: Path) -> None:
        pass

    def load_extra(self, run: RunParts, folder: Path) -> None:
        pass


class ModelLoss(LossMoments):
    """The model's own loss (labels are in the batch): a mean over the micro-batch, so every
    micro-batch of an optimizer step weighs the same."""

    token_weighted = False
    """Whether the loss is a sum that the loop weighs by the step's labelled tokens."""
    name = "model"
    """In the metrics JSON (``loss.implementation``)."""
    chunked = False
    """Whether it computes the logits chunk by chunk, never all at once (the chunked loss)."""

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        loss: torch.Tensor = model(**batch).loss
        return loss

    def describe(self) -> list[str]:
        """The banner's lines about the loss (none: nothing to say)."""
        return []

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.name, "weighting": "micro-batch mean"}

    def window_metrics(self, accelerator: Accelerator) -> dict[str, float]:
        """None: the loss is all the log line says."""
        return {}


class Task:
    """One task's pipeline. Methods import what they need when called, so that importing a
    task (``--help``, the report) loads no torch."""

    name: str
    speed_unit: str
    """What throughput counts: ``samples`` or ``tokens`` (padding left out)."""
    lr_divisor: LrDivisor | None = None
    """What divides the optimizer's default lr on pretrained weights for this task; None: the
    default as it is."""

    def check_options(self, config: TrainConfig) -> None:
        """Refuse options that belong to the other task or do not fit this one (EffitrainError)."""

    def load_data(self, config: TrainConfig) -> Any:
        """The raw training and validation splits, with columns and format resolved."""
        raise NotImplementedError

    def load_model(
        self,
        config: TrainConfig,
        data: Any,
        tokenizer: PreTrainedTokenizerBase | None,
        options: LoadOptions,
    ) -> PreTrainedModel:
        """The model to train: a preset (random init) or pretrained weights, read as
        ``options`` say (the levers' :class:`~effitrain.models.LoadOptions`)."""
        raise NotImplementedError

    def model_from_config(
        self, config: TrainConfig, data: Any, tokenizer: PreTrainedTokenizerBase | None
    ) -> PreTrainedModel:
        """The same model built from its config alone, no weights read (``effitrain estimate``
        calls it on the meta device). ``data`` may be None where the model needs none."""
        raise NotImplementedError

    def estimate_reads_data(self, config: TrainConfig) -> bool:
        """Whether ``effitrain estimate`` must load the data (a classifier's head is sized from
        its labels); a task whose shapes come from the model alone needs none."""
        return True

    def estimate_shape(
        self,
        config: TrainConfig,
        data: Any,
        tokenizer: PreTrainedTokenizerBase | None,
        length: int,
    ) -> tuple[int, int]:
        """The rows and the length of ``effitrain estimate``'s micro-batch (:meth:`fake_batch`):
        ``--batch-size`` examples, ``length`` tokens long (``--max-length``, capped as the run
        caps it)."""
        return config.batch_size, length

    def estimate_batch(self, config: TrainConfig, length: int) -> str:
        """:meth:`estimate_shape`'s micro-batch in words, ``length`` tokens a row (the
        estimate's notes)."""
        return f"{config.batch_size} x {length} token ids"

    def batch_unit(self, config: TrainConfig) -> int:
        """The micro-batch every ``--batch-size`` of this task is a multiple of (1: any)."""
        return 1

    def check_model(self, config: TrainConfig, data: Any, model: PreTrainedModel) -> None:
        """Fit the data options to the loaded model (may change ``data``, add notes)."""

    def dataloaders(
        self,
        config: TrainConfig,
        data: Any,
        tokenizer: PreTrainedTokenizerBase | None,
        pad_to_multiple_of: int | None,
    ) -> tuple[DataLoader[Any], DataLoader[Any]]:
        """Tokenized, shuffled training and ordered evaluation loaders."""
        raise NotImplementedError

    def loss_function(
        self,
        model: torch.nn.Module,
        device: torch.device,
        sharded: str | None,
        options: LossOptions,
        *,
        config: TrainConfig,
    ) -> Loss:
        """How this task computes a micro-batch's loss (``model``: unwrapped, levers applied;
        ``sharded``: FSDP's or DeepSpeed's description, None when parameters are whole;
        ``options``: the levers' (``effitrain.levers.loss_options``); ``config``: the run's, for
        a loss with options of its own, such as the preference losses). Defaults to the model's
        own loss, a mean over the micro-batch."""
        return ModelLoss()

    def evaluate(self, run: RunParts) -> dict[str, Any]:
        """Metrics over the whole validation set, each example counted once on all processes."""
        raise NotImplementedError

    def data_line(self, data: Any, train_loader: DataLoader[Any]) -> str:
        """The banner's words for what the data became (columns, labels, packing …)."""
        raise NotImplementedError

    def fake_batch(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        batch_size: int,
        length: int,
        packed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """A full batch as the collator makes it, every example ``length`` tokens long
        (``effitrain estimate``; ``packed``: the run packs its examples, for a task that
        does). With no tokenizer (a model known by its config alone), token ids and an
        attention mask of that shape: what a causal LM's tokenizer gives."""
        import torch

        if tokenizer is None:
            # Only shapes matter on fake tensors: any id in the vocabulary will do.
            input_ids = torch.zeros(batch_size, length, dtype=torch.long)
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        batch = dict(
            tokenizer(
                ["a"] * batch_size,
                padding="max_length",
                truncation=True,
                max_length=length,
                return_tensors="pt",
            )
        )
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
        return batch
