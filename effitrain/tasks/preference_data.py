"""Preference data: pairs of a preferred (``chosen``) and a dispreferred (``rejected``) answer to
one prompt, in TRL's formats, tokenized as TRL's ``DPOTrainer`` tokenizes them.

Formats (by the columns and the type of their values):

- explicit prompt: ``prompt``, ``chosen``, ``rejected`` strings;
- conversational: the three as message lists (``[{"role": ..., "content": ...}]``), rendered
  with the tokenizer's chat template (ChatML where it has none);
- implicit prompt: ``chosen`` and ``rejected`` only (strings, or conversations sharing their
  first turns); the prompt is their common start, as ``trl.data_utils.extract_prompt`` cuts it.

Tokenizing follows TRL 1.16's ``DPOTrainer._prepare_dataset``: string answers get the eos
token appended (conversations end as the template ends them); the prompt is tokenized alone
(conversations with the generation prompt), and prompt + answer together; the answer starts
where the two token lists first differ (``common_prefix_length``), which is not always after the
prompt (tokens may merge across the boundary). tests/test_preference_data.py checks the ids
against TRL's own on each format.

A batch holds each pair twice, TRL's concatenated order: rows 0..B-1 prompt + chosen, rows
B..2B-1 prompt + rejected, right-padded, labels only on the answers (not shifted), and each
pair's stable ``example`` id (training rows 0..N-1, validation rows N..N+M-1), which keys
precomputed reference log-probs whatever the shuffling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from effitrain.errors import EffitrainError
from effitrain.models import capped_length
from effitrain.tasks.lm_data import CHAT_ROLES, CHATML_TEMPLATE, IGNORE_INDEX
from effitrain.tasks.sources import hold_out, load_splits, loaders, train_and_validation

if TYPE_CHECKING:
    import datasets
    from torch.utils.data import DataLoader
    from transformers import BatchEncoding, PreTrainedTokenizerBase

    from effitrain.config import TrainConfig

ANSWERS = ("chosen", "rejected")
FORMATS = {
    "explicit": "prompt/chosen/rejected",
    "conversational": "prompt/chosen/rejected, chat template",
    "implicit": "chosen/rejected, prompt = their common start",
    "implicit-conversational": "chosen/rejected conversations, prompt = their common turns",
}
"""The formats, and the banner's words for each."""


@dataclass
class PreferenceData:
    """Raw train/validation splits of preference pairs, with their format resolved."""

    train: datasets.Dataset
    validation: datasets.Dataset
    format: str
    """A key of FORMATS."""
    source: str
    validation_source: str
    notes: list[str] = field(default_factory=list)
    """Things worth telling the user (truncation, a chat template supplied);
    build_preference_dataloaders adds to them."""

    @property
    def conversational(self) -> bool:
        return self.format.endswith("conversational")


def _demo_pairs() -> tuple[datasets.DatasetDict, str]:
    from effitrain.demo.preference_pairs import build_demo_pairs

    return build_demo_pairs(), "built-in demo preference pairs"


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )


def _detect_format(columns: list[str], first: dict[str, Any], source: str) -> str:
    """The format from the columns and the first row's values."""
    if not all(c in columns for c in ANSWERS):
        raise EffitrainError(
            f"{source}: no preference columns; columns found: {', '.join(columns) or '(none)'}; "
            "accepted: prompt+chosen+rejected (strings or message lists), or chosen+rejected "
            "(the prompt is their common start)"
        )
    conversational = isinstance(first["chosen"], list)
    if "prompt" in columns:
        return "conversational" if conversational else "explicit"
    return "implicit-conversational" if conversational else "implicit"


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """The prompt, chosen and rejected answers of an implicit-prompt pair: the longest common
    start of the two (characters of strings, messages of conversations), less a space that
    ends it. ``trl.data_utils.extract_prompt``, line for line (quirks included: where one is
    a prefix of the other, the last common item stays in the answers)."""
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":  # remove space before the prompt
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def _check_rows(split: datasets.Dataset, fmt: str, name: str) -> None:
    """Every row has non-empty, differing answers of the format's type (index = the row's 0-based
    index in the split as loaded).

    Raises:
        EffitrainError: naming the split and the row.
    """
    conversational = fmt.endswith("conversational")
    kind = "a non-empty message list ([{role, content}])" if conversational else "a string"
    columns = ANSWERS if fmt.startswith("implicit") else ("prompt", *ANSWERS)
    values = [split[c] for c in columns]
    for index, row in enumerate(zip(*values, strict=True)):
        pair = dict(zip(columns, row, strict=True))
        for column, value in pair.items():
            ok = (
                _is_conversation(value) and bool(value)
                if conversational
                else isinstance(value, str)
            )
            if not ok:
                raise EffitrainError(
                    f"{name} row index {index}: '{column}' must be {kind} like the first row's, "
                    f"got {repr(value)[:60]}"
                )
            roles = [m["role"] for m in value] if conversational else []
            wrong = next((role for role in roles if role not in CHAT_ROLES), None)
            if wrong is not None:
                raise EffitrainError(
                    f"{name} row index {index}: a message of '{column}' has role '{wrong}'; roles "
                    f"allowed: {', '.join(CHAT_ROLES)}"
                )
        chosen, rejected = pair["chosen"], pair["rejected"]
        if chosen == rejected:
            raise EffitrainError(
                f"{name} row index {index}: 'chosen' and 'rejected' are identical; a pair needs "
                "two different answers (drop the row)"
            )
        if fmt.startswith("implicit"):
            _, chosen, rejected = extract_prompt(chosen, rejected)
        for column, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer or (isinstance(answer, str) and not answer.strip()):
                raise EffitrainError(
                    f"{name} row index {index}: the '{column}' answer is empty; fill it or drop "
                    "the row"
                )


def load_preference_data(config: TrainConfig) -> PreferenceData:
    """Load the training and validation pairs and detect their format.

    Validation data is ``--validation-file``, else the dataset's validation split, else 10% of
    train (seeded), as for the other tasks.

    Raises:
        EffitrainError: missing or empty data, no preference columns, a bad row.
    """
    splits, source, notes = load_splits(config, demo=_demo_pairs)
    train, validation, validation_source = train_and_validation(config, splits, source)
    if len(train) == 0:
        raise EffitrainError(f"the training set of {source} is empty")
    fmt = _detect_format(list(train.column_names), train[0], source)
    _check_rows(train, fmt, f"training data ({source})")
    if validation is not None:
        found = _detect_format(list(validation.column_names), validation[0], validation_source)
        if found != fmt:
            raise EffitrainError(
                f"the validation data ({validation_source}) is {FORMATS[found]} but the training "
                f"data is {FORMATS[fmt]}; give both in one format"
            )
        _check_rows(validation, fmt, f"validation data ({validation_source})")
    else:
        train, validation, validation_source = hold_out(train, config.seed, source)
    if len(validation) == 0:
        raise EffitrainError(f"the validation set ({validation_source}) is empty")
    return PreferenceData(
        train=train,
        validation=validation,
        format=fmt,
        source=source,
        validation_source=validation_source,
        notes=notes,
    )


# --- tokenizing ---


def tokenize_pair(
    row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, fmt: str
) -> dict[str, list[int]]:
    """One pair's ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` as TRL's
    ``DPOTrainer._prepare_dataset`` makes them (the answers' ids exclude the prompt's)."""
    if fmt.startswith("implicit"):
        prompt, chosen, rejected = extract_prompt(row["chosen"], row["rejected"])
    else:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if fmt.endswith("conversational"):

        def ids(messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
            # Tokenized into a dict: a BatchEncoding (transformers types every return kind).
            encoded = cast(
                "BatchEncoding",
                tokenizer.apply_chat_template(
                    messages,
                    tokenize=True,
                    return_dict=True,
                    add_generation_prompt=generation_prompt,
                ),
            )
            return list(encoded["input_ids"])

        prompt_ids = ids(prompt, generation_prompt=True)
        prompt_chosen, prompt_rejected = ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        prompt_chosen = tokenizer(text=prompt + chosen)["input_ids"]
        prompt_rejected = tokenizer(text=prompt + rejected)["input_ids"]
    # The answer starts where the prompt's tokens and the whole sequence's first differ: a chat
    # template may render a prompt alone otherwise, and tokens may merge across the boundary.
    length = min(
        _common_prefix(prompt_ids, prompt_chosen), _common_prefix(prompt_ids, prompt_rejected)
    )
    return {
        "prompt_ids": prompt_ids[:length],
        "chosen_ids": prompt_chosen[length:],
        "rejected_ids": prompt_rejected[length:],
    }


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def truncate(prompt: list[int], answer: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Prompt and answer cut to ``max_length`` tokens together: the prompt's start goes first
    (its end, next to the answer, stays), then the answer's end, only where the answer alone is
    longer."""
    if len(prompt) + len(answer) <= max_length:
        return prompt, answer
    if len(answer) >= max_length:
        return [], answer[:max_length]
    return prompt[len(prompt) + len(answer) - max_length :], answer


def _encoder(fmt: str, tokenizer: PreTrainedTokenizerBase, max_length: int, first_id: int):
    """The batched ``datasets.map`` function: each pair's two sequences (prompt + answer, cut
    to ``max_length``), where each answer starts, whether either was cut, and its example id."""

    def encode(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "chosen_input_ids": [],
            "chosen_start": [],
            "rejected_input_ids": [],
            "rejected_start": [],
            "cut": [],
            "example": [],
            "empty": [],
        }
        for offset, index in enumerate(indices):
            row = {column: values[offset] for column, values in batch.items()}
            ids = tokenize_pair(row, tokenizer, fmt)
            cut = False
            for answer in ANSWERS:
                prompt, tokens = truncate(ids["prompt_ids"], ids[f"{answer}_ids"], max_length)
                cut |= len(prompt) + len(tokens) < len(ids["prompt_ids"]) + len(
                    ids[f"{answer}_ids"]
                )
                out[f"{answer}_input_ids"].append(prompt + tokens)
                out[f"{answer}_start"].append(len(prompt))
            out["cut"].append(cut)
            out["example"].append(first_id + index)
            out["empty"].append(not ids["chosen_ids"] or not ids["rejected_ids"])
        return out

    return encode


def tokenize_preference(
    data: PreferenceData, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenize both splits into pairs of sequences, example ids numbering training rows
    first. Adds a note per split where --max-length cut examples. ``max_length`` is capped by
    the tokenizer's ``model_max_length``.

    Raises:
        EffitrainError: no eos token (string answers end with it), or an answer with no token.
    """
    if tokenizer.eos_token_id is None and not data.conversational:
        raise EffitrainError(
            "the tokenizer has no end-of-sequence token, which ends each answer; use a tokenizer "
            "with an eos_token"
        )
    limit = capped_length(max_length, tokenizer.model_max_length, data.notes)
    if data.conversational and tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
        data.notes.append(
            "the tokenizer has no chat template; using ChatML (<|im_start|>role ... "
            "<|im_end|>), saved with the tokenizer"
        )
    results = []
    first_id = 0
    for name, split in (("training", data.train), ("validation", data.validation)):
        encoded = split.map(
            _encoder(data.format, tokenizer, limit, first_id),
            batched=True,
            with_indices=True,
            remove_columns=split.column_names,
            desc=f"Tokenizing {name} pairs",
        )
        empty = encoded["empty"]
        if any(empty):
            index = empty.index(True)
            raise EffitrainError(
                f"{name} pair {index}: an answer has no token of its own once tokenized (its "
                "tokens merge into the prompt's); end the prompt on a word boundary or drop the row"
            )
        cut = sum(encoded["cut"])
        if cut:
            data.notes.append(
                f"{cut} of {len(encoded)} {name} examples were cut to --max-length {limit} "
                "(prompt start first)"
            )
        results.append(encoded.remove_columns(["cut", "empty"]))
        first_id += len(split)
    return results[0], results[1]


# --- batching ---


class PreferenceCollator:
    """A preference batch from pairs: ``input_ids``, ``attention_mask``, ``labels`` of shape
    [2B, L] (chosen rows first, then rejected; right-padded to the longest, or to a multiple
    of ``pad_to_multiple_of``; labels -100 on prompt and padding, not shifted), and the pairs'
    ``example`` ids [B]."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        sequences = [(f[f"{a}_input_ids"], f[f"{a}_start"]) for a in ANSWERS for f in features]
        length = max(len(ids) for ids, _ in sequences)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids, attention_mask, labels = [], [], []
        for ids, start in sequences:
            pad = length - len(ids)
            input_ids.append(list(ids) + [self.pad_token_id] * pad)
            attention_mask.append([1] * len(ids) + [0] * pad)
            labels.append([IGNORE_INDEX] * start + list(ids[start:]) + [IGNORE_INDEX] * pad)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.int64),
            "attention_mask": torch.tensor(attention_mask, dtype=torch.int64),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "example": torch.tensor([f["example"] for f in features], dtype=torch.int64),
        }


def build_preference_dataloaders(
    data: PreferenceData,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig,
    pad_to_multiple_of: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training and ordered evaluation loaders of preference batches (each batch of
    ``--batch-size`` pairs is 2 x that many sequences). A tokenizer without a pad token gets its
    eos token as pad token (pads are never trained on)."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        data.notes.append("the tokenizer has no pad token; using its eos token for padding")
    train, validation = tokenize_preference(data, tokenizer, config.max_length)
    collator = PreferenceCollator(tokenizer.pad_token_id, pad_to_multiple_of)
    return loaders(train, validation, collator, config)
