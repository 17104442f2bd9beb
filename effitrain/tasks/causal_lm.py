"""Causal-LM training: next-token loss on documents, prompt/completion, instruction or chat data
(the pipeline is :mod:`.lm_data`), a ``*ForCausalLM`` model, and its evaluation: token-weighted
validation loss and perplexity, and a greedy sample.

Every token with a label counts once: each process sums the per-token losses of each sequence,
``gather_for_metrics`` drops the sequences that the last batch repeats to even out processes,
and the sums are divided by the token count. Perplexity is ``exp(loss)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import effitrain.models as models
import effitrain.tasks.document_attention as document_attention
from effitrain.errors import EffitrainError
from effitrain.tasks.base import CAUSAL_LM, Task
from effitrain.tasks.lm_data import (
    IGNORE_INDEX,
    LMData,
    build_lm_dataloaders,
    check_packing,
    fake_lm_batch,
    load_lm_data,
)

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from effitrain.config import TrainConfig
    from effitrain.levers.spec import LossOptions
    from effitrain.parts import RunParts
    from effitrain.tasks.lm_loss import Choice, LMLoss

SAMPLE_TOKENS = 40
"""Tokens a ``--sample-prompt`` continuation runs to (greedy, stops earlier at eos)."""


def evaluate_lm(run: RunParts) -> dict[str, Any]:
    """Validation loss and perplexity over every labelled token; with a sample prompt (given,
    or the built-in demo's), its greedy continuation under ``"sample"``.

    The batch's full fp32 logits are never held: the run's loss computes each sequence's loss
    sum chunk by chunk (:meth:`effitrain.tasks.lm_loss.LMLoss.sequence_sums`)."""
    import torch

    from effitrain.tasks.lm_loss import LMLoss

    model, accelerator, lm_loss = run.model, run.accelerator, run.loss
    assert isinstance(lm_loss, LMLoss)  # a decoder task's
    loss_sums, token_counts = [], []
    for batch in run.eval_loader:
        sums = lm_loss.sequence_sums(model, batch)
        counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=-1)
        sums, counts = accelerator.gather_for_metrics((sums, counts))
        loss_sums.append(sums.double().cpu())
        token_counts.append(counts.cpu())
    tokens = int(torch.cat(token_counts).sum())
    loss = float(torch.cat(loss_sums).sum()) / max(tokens, 1)
    metrics: dict[str, Any] = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
        "tokens": tokens,
        "examples": int(sum(len(c) for c in token_counts)),
    }
    prompt = sample_prompt(run)
    if prompt:
        metrics["sample"] = generate_sample(run, prompt)
    return metrics


def sample_prompt(run: RunParts) -> str | None:
    """``--sample-prompt``, else the demo corpus's own prompt when training on it."""
    config = run.config
    if config.sample_prompt is not None:
        return config.sample_prompt or None
    if config.uses_builtin_data:
        from effitrain.demo.lm import DEMO_SAMPLE_PROMPT

        return DEMO_SAMPLE_PROMPT
    return None


def generate_sample(run: RunParts, prompt: str, max_new_tokens: int = SAMPLE_TOKENS) -> str:
    """The greedy continuation of ``prompt`` (the new text only). With instruction or chat
    data, the prompt is a user turn rendered by the chat template the data was rendered with.

    Every process generates (under FSDP each forward is a collective); the main one prints.
    """
    import torch

    tokenizer = run.tokenizer
    assert tokenizer is not None  # only an estimate has none, and it never evaluates
    model = run.accelerator.unwrap_model(run.model)
    if run.data.format in ("instruction", "messages"):
        # Not tokenized: the rendered text (transformers types every return kind).
        prompt = cast(
            "str",
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            ),
        )
        encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    encoded = encoded.to(run.accelerator.device)
    with torch.no_grad():
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,  # off for training (effitrain.models), on for generating
            pad_token_id=tokenizer.pad_token_id,
        )
    new = output[0, encoded["input_ids"].shape[1] :]
    return cast("str", tokenizer.decode(new, skip_special_tokens=True))  # one sequence: one text


class DecoderTask(Task):
    """What every task that trains a ``*ForCausalLM`` shares: the model, loaded or built from
    its config, and the chunked loss's implementation for it."""

    speed_unit = "tokens"

    def load_model(
        self, config: TrainConfig, data: Any, tokenizer: Any, options: models.LoadOptions
    ) -> PreTrainedModel:
        return models.load_causal_lm(config.model, tokenizer, options, data.notes)

    def model_from_config(
        self, config: TrainConfig, data: Any, tokenizer: PreTrainedTokenizerBase | None
    ) -> PreTrainedModel:
        return models.model_from_config(config.model, tokenizer, causal_lm=True)

    def estimate_reads_data(self, config: TrainConfig) -> bool:
        return False  # no labels to size a head from: the shapes come from the model

    @staticmethod
    def loss_choice(
        model: torch.nn.Module,
        device: torch.device,
        sharded: str | None,
        options: LossOptions,
    ) -> Choice:
        """The chunked loss's implementation (``--chunked-loss``, via the levers' ``options``)."""
        from effitrain.tasks.lm_loss import choose

        return choose(options.chunked, model, device, sharded)


class CausalLMTask(DecoderTask):
    """Causal-LM training: ``*ForCausalLM``, packed or padded sequences, perplexity."""

    name = CAUSAL_LM

    def check_options(self, config: TrainConfig) -> None:
        if config.max_length < 2:
            raise EffitrainError(
                f"--max-length {config.max_length} leaves no token to train on: a causal LM "
                "learns to predict each token from the ones before it, so a sequence needs 2 "
                "tokens or more; raise --max-length"
            )

    def load_data(self, config: TrainConfig) -> LMData:
        return load_lm_data(config)

    def load_model(
        self, config: TrainConfig, data: Any, tokenizer: Any, options: models.LoadOptions
    ) -> PreTrainedModel:
        model = super().load_model(config, data, tokenizer, options)
        document_attention.use(model)
        return model

    def model_from_config(
        self, config: TrainConfig, data: Any, tokenizer: PreTrainedTokenizerBase | None
    ) -> PreTrainedModel:
        model = super().model_from_config(config, data, tokenizer)
        document_attention.use(model)
        return model

    def check_model(self, config: TrainConfig, data: LMData, model: PreTrainedModel) -> None:
        check_packing(data, model.config.model_type, config)

    def dataloaders(
        self, config: TrainConfig, data: LMData, tokenizer: Any, pad_to_multiple_of: int | None
    ) -> tuple[DataLoader[Any], DataLoader[Any]]:
        return build_lm_dataloaders(data, tokenizer, config, pad_to_multiple_of)

    def loss_function(
        self,
        model: torch.nn.Module,
        device: torch.device,
        sharded: str | None,
        options: LossOptions,
        *,
        config: TrainConfig,
    ) -> LMLoss:
        from effitrain.tasks.lm_loss import LMLoss

        return LMLoss(self.loss_choice(model, device, sharded, options), model)

    def evaluate(self, run: RunParts) -> dict[str, Any]:
        return evaluate_lm(run)

    def data_line(self, data: LMData, train_loader: Any) -> str:
        plural = "s" if len(data.columns) > 1 else ""
        sequences = len(train_loader.dataset) if train_loader is not None else 0
        return (
            f"{data.format} data in column{plural} {' + '.join(data.columns)}, "
            + ("packed" if data.packing else "padded")
            + f" into {sequences:,} training sequences"
            + (", loss on completions only" if data.completion_only else "")
        )

    def fake_batch(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        batch_size: int,
        length: int,
        packed: bool = False,
    ) -> dict[str, Any]:
        return fake_lm_batch(tokenizer, batch_size, length, packed)
