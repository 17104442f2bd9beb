"""GRPO's prompts (``--task grpo``), in TRL's formats: a ``prompt`` column holding a string, or a
chat (a list of ``{"role", "content"}`` messages, rendered with the tokenizer's chat template and
its generation prompt; ChatML where it has none). Every other column goes to the reward
functions, as TRL hands them over. The built-in demo's prompts are the first words of the demo
corpus's reports.

A batch is a list of rows (``--batch-size`` / G of them); the prompts are tokenized where they
are generated from (:mod:`.grpo_loss`), left-padded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from effitrain.errors import EffitrainError
from effitrain.tasks.lm_data import CHATML_TEMPLATE, is_conversation
from effitrain.tasks.sources import hold_out, load_splits, loaders, train_and_validation

if TYPE_CHECKING:
    import datasets
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.config import TrainConfig

DEMO_PROMPT_WORDS = 4
"""The demo's prompts: each report's first words ("On Monday, the committee")."""
DEMO_PROMPTS = {"train": 120, "validation": 32}
"""How many the demo takes of each split: 60 steps an epoch of the default batch (16
completions, 2 prompts x 8), 300 in the default 5 epochs, and a quick evaluation after each."""


@dataclass
class PromptData:
    """Raw train/validation splits of prompts, with their format resolved."""

    train: datasets.Dataset
    validation: datasets.Dataset
    conversational: bool
    """The prompts are chats (rendered with a chat template), not strings."""
    source: str
    validation_source: str
    notes: list[str] = field(default_factory=list)


def _demo_prompts() -> tuple[datasets.DatasetDict, str]:
    import datasets

    from effitrain.demo.lm import build_demo_corpus

    corpus = build_demo_corpus()
    splits = {
        name: datasets.Dataset.from_dict(
            {
                "prompt": [
                    " ".join(text.split()[:DEMO_PROMPT_WORDS])
                    for text in split["text"][: DEMO_PROMPTS[name]]
                ]
            }
        )
        for name, split in corpus.items()
    }
    return datasets.DatasetDict(splits), "built-in demo prompts (the demo corpus's openings)"


def _check_prompts(split: datasets.Dataset, source: str) -> bool:
    """Whether the prompts are chats; refuses a missing column and a row of neither kind."""
    if "prompt" not in split.column_names:
        raise EffitrainError(
            f"{source} has no 'prompt' column (columns: {', '.join(split.column_names)}); "
            "--task grpo reads prompts from it (a string or a chat)"
        )
    prompts = split["prompt"]
    conversational = is_conversation(prompts[0])
    for row, prompt in enumerate(prompts):
        if conversational and not is_conversation(prompt):
            raise EffitrainError(
                f"{source}, row {row}: 'prompt' is not a chat like the first row's (a list of "
                '{"role", "content"} messages)'
            )
        if not conversational and not (isinstance(prompt, str) and prompt):
            raise EffitrainError(
                f"{source}, row {row}: 'prompt' must be a non-empty string or a chat (got "
                f"{type(prompt).__name__})"
            )
    return conversational


def load_prompt_data(config: TrainConfig) -> PromptData:
    """The training and validation prompts: ``--validation-file``, else the dataset's
    validation split, else 10% of train (seeded), as for the other tasks.

    Raises:
        EffitrainError: missing or empty data, no ``prompt`` column, a bad row, or formats
            that differ between the splits.
    """
    splits, source, notes = load_splits(config, demo=_demo_prompts)
    train, validation, validation_source = train_and_validation(config, splits, source)
    if len(train) == 0:
        raise EffitrainError(f"the training set of {source} is empty")
    conversational = _check_prompts(train, f"the training data ({source})")
    if validation is None:
        train, validation, validation_source = hold_out(train, config.seed, source)
    elif len(validation) == 0:
        raise EffitrainError(f"the validation set ({validation_source}) is empty")
    elif _check_prompts(validation, f"the validation data ({validation_source})") != (
        conversational
    ):
        raise EffitrainError(
            f"the validation prompts ({validation_source}) and the training prompts are not "
            "both strings or both chats; give both in one format"
        )
    return PromptData(train, validation, conversational, source, validation_source, notes)


def prompt_texts(prompts: list[Any], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each prompt as the text generation continues: a string as it is, a chat rendered with
    the tokenizer's chat template (ChatML where it has none) and its generation prompt."""
    if not prompts or not is_conversation(prompts[0]):
        return list(prompts)
    template = tokenizer.chat_template or CHATML_TEMPLATE
    return [
        cast(
            "str",
            tokenizer.apply_chat_template(
                chat, chat_template=template, tokenize=False, add_generation_prompt=True
            ),
        )
        for chat in prompts
    ]


def encode_prompts(prompts: list[Any], tokenizer: PreTrainedTokenizerBase, **options: Any) -> Any:
    """The prompts' token ids as generation takes them (:func:`prompt_texts`, the tokenizer's
    special tokens where no chat template wrote its own); ``options``: the tokenizer's
    (padding, tensors)."""
    texts = prompt_texts(prompts, tokenizer)
    return tokenizer(texts, add_special_tokens=not is_conversation(prompts[0]), **options)


def longest_prompt(data: PromptData, tokenizer: PreTrainedTokenizerBase) -> int:
    """The training data's longest prompt, in tokens, as generation tokenizes it."""
    encoded = encode_prompts(list(data.train["prompt"]), tokenizer)["input_ids"]
    return max(len(ids) for ids in encoded)


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of prompts: the rows as they are (``rows``), for generation and the rewards."""
    return {"rows": rows}


def build_prompt_dataloaders(
    data: PromptData, config: TrainConfig, prompts_per_batch: int
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Shuffled training and ordered evaluation loaders of ``prompts_per_batch`` prompts."""
    # Evaluation generates one completion per prompt: as many prompts as a batch's completions.
    per_batch = dataclasses.replace(
        config,
        batch_size=prompts_per_batch,
        eval_batch_size=config.eval_batch_size or 2 * config.batch_size,
    )
    return loaders(data.train, data.validation, collate_rows, per_batch)
