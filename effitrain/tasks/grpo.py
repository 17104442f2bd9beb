"""Online RL with GRPO (``--task grpo``): a ``*ForCausalLM`` samples G completions of each
prompt, reward functions score them, and the policy learns from each completion's reward
relative to its group's, as TRL 1.16's ``GRPOTrainer`` (the step is :mod:`.grpo_loss`, the
prompts :mod:`.grpo_data`, the rewards :mod:`.grpo_rewards`).

The model and its loading are the causal LM's. ``--batch-size`` counts completions, as TRL's
``per_device_train_batch_size`` does: a micro-batch holds batch-size / G prompts. It
generates with transformers' ``generate`` (each generation trained on for
``--num-iterations`` steps); with ``--beta`` above 0 (TRL's default is 0) the KL to a reference
model joins the loss, the reference taken through the ``--reference`` lever. ``effitrain
estimate`` and ``plan`` count both phases of a step: the generation (the run's own, on fake
tensors, every completion full length) and the training step on its completions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.config import default_for, option
from effitrain.errors import EffitrainError
from effitrain.optim import LrDivisor
from effitrain.tasks.base import CAUSAL_LM_OPTIONS, GRPO
from effitrain.tasks.causal_lm import DecoderTask
from effitrain.tasks.grpo_data import (
    PromptData,
    build_prompt_dataloaders,
    load_prompt_data,
    longest_prompt,
)
from effitrain.tasks.grpo_rewards import check_reward_spec, check_weights

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from effitrain.config import TrainConfig
    from effitrain.levers.spec import LossOptions
    from effitrain.parts import RunParts
    from effitrain.tasks.grpo_loss import GrpoLoss

REFUSED_OPTIONS = (
    *CAUSAL_LM_OPTIONS,
    "preference_loss",
    "label_smoothing",
    "simpo_gamma",
)
"""Options GRPO does not take: the causal LM's data shaping and sample, the preference losses'
(the chunked loss refuses GRPO itself: its lever's ``task``)."""


def _prompt_length_given(config: TrainConfig) -> bool:
    """Whether ``--max-length`` was given: an estimate's prompt length (generation does not
    truncate prompts). The config keeps no record of which options were given (the command
    line's and the YAML file's are merged into values), so a length other than the default
    counts as given."""
    return bool(config.max_length != default_for("max_length"))


class GrpoTask(DecoderTask):
    """GRPO: ``*ForCausalLM``, prompts, sampled groups of completions, rewards."""

    name = GRPO
    lr_divisor = LrDivisor(40, "GRPO")
    """The fine-tuning (or LoRA) lr over 40, as preference tuning's: AdamW 5e-6 (TRL's GRPO
    default is 1e-6)."""

    def check_options(self, config: TrainConfig) -> None:
        given = [option(n) for n in REFUSED_OPTIONS if getattr(config, n) != default_for(n)]
        if given:
            raise EffitrainError(f"{given[0]} does not apply to --task grpo; drop it")
        if config.beta is not None and not config.beta >= 0:
            raise EffitrainError(
                f"--beta must be 0 or more under --task grpo (got {config.beta:g}): the KL "
                "penalty's coefficient"
            )
        group = config.num_generations
        if group < 2:
            raise EffitrainError(
                f"--num-generations must be 2 or more (got {group}): a group's advantages are "
                "its rewards against its own mean"
            )
        if config.batch_size % group:
            raise EffitrainError(
                f"--batch-size {config.batch_size} counts completions and must be a multiple of "
                f"--num-generations {group} (each prompt's group in one micro-batch)"
            )
        length = config.max_completion_length
        if length is not None and length < 1:
            raise EffitrainError(f"--max-completion-length must be 1 or more (got {length})")
        if not config.temperature > 0:
            raise EffitrainError(f"--temperature must be greater than 0 (got {config.temperature})")
        if not 0 < config.top_p <= 1:
            raise EffitrainError(f"--top-p must be above 0 and at most 1 (got {config.top_p})")
        if config.num_iterations < 1:
            raise EffitrainError(
                f"--num-iterations must be 1 or more (got {config.num_iterations})"
            )
        for name in ("epsilon", "epsilon_high"):
            value = getattr(config, name)
            if value is not None and not value >= 0:
                raise EffitrainError(f"{option(name)} must be 0 or more (got {value})")
        for spec in config.reward or []:
            check_reward_spec(spec)
        check_weights(config.reward_weights, config.reward or ["built-in"])

    def load_data(self, config: TrainConfig) -> PromptData:
        return load_prompt_data(config)

    def batch_unit(self, config: TrainConfig) -> int:
        return config.num_generations  # each prompt's group in one micro-batch

    def estimate_reads_data(self, config: TrainConfig) -> bool:
        return not _prompt_length_given(config)  # the data's longest prompt, else

    def estimate_shape(
        self, config: TrainConfig, data: Any, tokenizer: Any, length: int
    ) -> tuple[int, int]:
        """The micro-batch's batch-size / G prompts, which the run's own generation samples
        G completions of (:meth:`GrpoLoss.step_batches`): ``--max-length`` tokens long where
        given or where no tokenizer measures the prompts (a model known by its config.json:
        its note says the length, the default's included), else as long as the data's
        longest."""
        prompts = config.batch_size // config.num_generations
        if _prompt_length_given(config) or tokenizer is None:
            return prompts, length
        return prompts, longest_prompt(data, tokenizer)

    def estimate_batch(self, config: TrainConfig, length: int) -> str:
        from effitrain.tasks.grpo_loss import completion_length

        group = config.num_generations
        return (
            f"{config.batch_size // group} prompts of {length} token ids, {group} completions "
            f"each of {completion_length(config)} tokens"
        )

    def dataloaders(
        self,
        config: TrainConfig,
        data: PromptData,
        tokenizer: Any,
        pad_to_multiple_of: int | None,
    ) -> tuple[DataLoader[Any], DataLoader[Any]]:
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
            data.notes.append("the tokenizer has no pad token; using its eos token for padding")
        return build_prompt_dataloaders(data, config, config.batch_size // config.num_generations)

    def loss_function(
        self,
        model: torch.nn.Module,
        device: torch.device,
        sharded: str | None,
        options: LossOptions,
        *,
        config: TrainConfig,
    ) -> GrpoLoss:
        from effitrain.tasks.grpo_loss import GrpoLoss, GrpoSettings
        from effitrain.tasks.grpo_rewards import load_rewards

        rewards = load_rewards(config.reward)
        weights = check_weights(config.reward_weights, rewards)
        return GrpoLoss(GrpoSettings.of(config, weights), rewards, config.seed)

    def evaluate(self, run: RunParts) -> dict[str, Any]:
        from effitrain.tasks.grpo_loss import evaluate_grpo

        return evaluate_grpo(run)

    def data_line(self, data: PromptData, train_loader: Any) -> str:
        kind = "chats, chat template" if data.conversational else "strings"
        return f"prompts ({kind}) in column prompt, {len(data.train):,} for training"
