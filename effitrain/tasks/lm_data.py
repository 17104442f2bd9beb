"""Causal-LM data: load documents or instruction/chat records, tokenize, then pack or pad.

``load_lm_data`` finds the data (built-in corpus, hub id, local files or folders, through the
same loaders as classification, plus ``.txt``) and its format from the column names;
``build_lm_dataloaders`` tokenizes with the model's tokenizer and either packs the examples into
``--max-length`` blocks or pads each batch dynamically.

Packing keeps attention inside each document without an attention mask: a block carries
``position_ids`` that restart at 0 where a document starts, and transformers' masking utilities
(``find_packed_sequence_indices``, used when ``attention_mask`` is None and ``position_ids`` are
given) build a block-diagonal causal mask from them for sdpa and eager attention. The model must
be called with ``use_cache=False`` (a cache turns that detection off); tests/test_lm_data.py
checks that a packed block's logits equal each document's logits run alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.models import capped_length
from effitrain.tasks.document_attention import WithDocumentLengths
from effitrain.tasks.sources import (
    LABEL_COLUMN_CANDIDATES,
    LOCAL_FORMATS,
    hold_out,
    load_splits,
    loaders,
    train_and_validation,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    import datasets
    import numpy as np
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.config import TrainConfig

LM_FORMATS = {**LOCAL_FORMATS, ".txt": "text"}
"""Local file types for causal-LM data (a .txt file's blank-line-separated paragraphs are its
documents)."""

FORMAT_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("messages", ("messages",)),
    ("prompt-completion", ("prompt", "completion")),
    ("instruction", ("instruction", "output")),
    ("text", ("text",)),
)
"""Data formats by the columns that identify them, tried in this order."""

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (as chat templates know them); any other is refused, not
rendered as a turn the template may not know."""

IGNORE_INDEX = -100
"""Label of a token that is not trained on (the loss of transformers' models skips it)."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The chat template given to a tokenizer that has none (ChatML, as Qwen and SmolLM use):
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""


PACKING_KEEPS_DOCUMENTS_APART = frozenset(
    {
        "llama", "llama4_text", "mistral", "ministral", "mixtral", "qwen2", "qwen3",
        "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "smollm3", "gpt2",
        "gpt_neox", "gptj", "codegen", "gpt_bigcode", "falcon", "olmo", "olmo2", "olmo3",
        "granite", "granitemoe", "stablelm", "starcoder2", "cohere", "glm4", "helium",
    }
)  # fmt: skip
"""Architectures (``config.model_type``) whose attention follows per-document position_ids in
a packed block: packed logits equal each document's alone (benchmarks/causal_lm/ re-checks)."""

PACKING_MIXES_DOCUMENTS = frozenset({"opt", "bloom", "mpt", "xglm", "biogpt"})
"""Architectures that let packed documents attend to each other (benchmarks/causal_lm/)."""


def packs(config: TrainConfig, model_type: str, documents: bool = True) -> bool:
    """Whether a run packs its examples (as :func:`check_packing` leaves ``data.packing``):
    ``--packing``/``--no-packing``, else documents (``documents``: plain text) are packed, except
    on an architecture not known to keep packed documents apart."""
    packing = config.packing if config.packing is not None else documents
    return packing and (config.packing is not None or model_type in PACKING_KEEPS_DOCUMENTS_APART)


def fake_lm_batch(
    tokenizer: PreTrainedTokenizerBase | None, batch_size: int, length: int, packed: bool
) -> dict[str, Any]:
    """A training batch of ``batch_size`` examples of ``length`` tokens made by the run's own
    collators (``effitrain estimate``), shaped as real data reaches the model: a packed block
    holds two documents (real blocks hold several), and a padded batch of several rows has one
    padding token (real ones have some; a single row is never padded). Without a tokenizer (a
    model known by its config alone) padding is done as the collator does it."""
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    pad = pad if pad is not None else 0
    ids = [pad] * length
    if packed:
        half = length // 2
        positions = [*range(half), *range(length - half)]
        features = [{"input_ids": ids, "labels": ids, "position_ids": positions}] * batch_size
        return lm_collator(True, pad)(features)
    short = length - 1 if batch_size > 1 and length > 1 else length
    lengths = [length] * (batch_size - 1) + [short]
    rows = [{"input_ids": ids[:n], "attention_mask": [1] * n, "labels": ids[:n]} for n in lengths]
    padding = tokenizer if tokenizer is not None and tokenizer.pad_token_id is not None else None
    return lm_collator(False, pad, padding)(rows)


def _padded(pad: int, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Right-padded int64 tensors of ``rows``, as transformers' collator pads them."""
    import torch

    length = max(len(row["input_ids"]) for row in rows)
    mask = torch.tensor(
        [[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows]
    )
    input_ids = torch.full(mask.shape, pad, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": input_ids.masked_fill(mask == 0, IGNORE_INDEX),
    }


def check_packing(data: LMData, model_type: str, config: TrainConfig) -> None:
    """Packing only where the model keeps packed documents apart: refuse ``--packing`` where
    it is known not to, and pad by default where it is not known to.

    Raises:
        EffitrainError: --packing with an architecture that mixes packed documents.
    """
    if not data.packing or model_type in PACKING_KEEPS_DOCUMENTS_APART:
        return
    if config.packing and model_type in PACKING_MIXES_DOCUMENTS:
        raise EffitrainError(
            f"--packing: {model_type} models ignore per-document position ids, so packed "
            "documents would attend to each other; use --no-packing"
        )
    data.packing = packs(config, model_type, documents=data.packing)  # the estimate's rule too
    if data.packing:
        data.notes.append(
            f"--packing with {model_type}: not verified to keep packed documents apart "
            "(python -m benchmarks.causal_lm.run --what architectures checks it in a clone of "
            "effitrain)"
        )
    else:
        data.notes.append(
            f"padding instead of packing: {model_type} is not known to keep packed documents "
            "apart (force it with --packing)"
        )


@dataclass
class LMData:
    """Raw train/validation splits of causal-LM data, with their format and options resolved."""

    train: datasets.Dataset
    validation: datasets.Dataset
    format: str
    columns: tuple[str, ...]
    source: str
    validation_source: str
    completion_only: bool
    packing: bool
    notes: list[str] = field(default_factory=list)
    """Things worth telling the user (fallbacks taken, rows dropped, files skipped);
    build_lm_dataloaders adds to them."""


def has_label_column(columns: Iterable[str]) -> bool:
    """Whether the data has a column a classifier would take as its label."""
    return any(c in LABEL_COLUMN_CANDIDATES for c in columns)


def _demo_corpus() -> tuple[datasets.DatasetDict, str]:
    from effitrain.demo.lm import build_demo_corpus

    return build_demo_corpus(), "built-in demo corpus"


def _accepted() -> str:
    return "; ".join("+".join(columns) for _, columns in FORMAT_COLUMNS)


def _detect_format(columns: list[str], config: TrainConfig) -> tuple[str, tuple[str, ...]]:
    """The format and the columns it uses: ``--text-columns COL`` first, else by FORMAT_COLUMNS."""
    if config.text_columns:
        if len(config.text_columns) != 1:
            raise EffitrainError(
                f"--text-columns takes one column under --task causal-lm (got "
                f"{', '.join(config.text_columns)}); name the column that holds the text"
            )
        column = config.text_columns[0]
        if column not in columns:
            raise EffitrainError(
                f"--text-columns {column} not in the dataset; columns found: {', '.join(columns)}"
            )
        return "text", (column,)
    for name, needed in FORMAT_COLUMNS:
        if all(c in columns for c in needed):
            if name == "instruction" and "input" in columns:
                return name, ("instruction", "input", "output")
            return name, needed
    raise EffitrainError(
        f"no usable column for causal-lm; columns found: {', '.join(columns) or '(none)'}; "
        f"accepted: {_accepted()} (or --text-columns COL)"
    )


def _drop_empty_texts(split: datasets.Dataset, column: str) -> datasets.Dataset:
    return split.filter(
        lambda batch: [isinstance(t, str) and bool(t.strip()) for t in batch[column]],
        batched=True,
    )


def _check_rows(split: datasets.Dataset, fmt: str, name: str) -> None:
    """Every row has the values its format needs (index = the row's 0-based index in the split
    as loaded)."""
    if fmt == "messages":
        for index, messages in enumerate(split["messages"]):
            if not is_conversation(messages):
                raise EffitrainError(
                    f"{name} row index {index}: 'messages' must be a non-empty list of "
                    f"{{role, content}} with string values, got {repr(messages)[:60]}"
                )
            for number, message in enumerate(messages, start=1):
                if message["role"] not in CHAT_ROLES:
                    raise EffitrainError(
                        f"{name} row index {index}: message {number} has role "
                        f"'{message['role']}'; roles allowed: {', '.join(CHAT_ROLES)}"
                    )
        return
    needed = {
        "prompt-completion": ("prompt", "completion"),
        "instruction": ("instruction", "output"),
    }
    for column in needed.get(fmt, ()):
        for index, value in enumerate(split[column]):
            if not isinstance(value, str):
                raise EffitrainError(
                    f"{name} row index {index}: '{column}' is missing; fill it or drop the row"
                )


def load_lm_data(config: TrainConfig) -> LMData:
    """Load the training and validation splits of causal-LM data and detect their format.

    Rows whose text is empty are dropped (plain-text data). Validation data is
    ``--validation-file``, else the dataset's validation split, else 10% of train (seeded).

    Raises:
        EffitrainError: missing or empty data, no usable column, options that do not fit the data.
    """
    splits, source, notes = load_splits(config, demo=_demo_corpus, formats=LM_FORMATS)
    train, validation, validation_source = train_and_validation(config, splits, source, LM_FORMATS)
    if len(train) == 0:
        raise EffitrainError(f"the training set of {source} is empty")
    fmt, columns = _detect_format(list(train.column_names), config)
    if fmt == "text":
        kept = _drop_empty_texts(train, columns[0])
        if len(kept) == 0:
            raise EffitrainError(
                f"the training set of {source} is empty: every '{columns[0]}' value is empty"
            )
        if len(kept) < len(train):
            notes.append(f"dropped {len(train) - len(kept)} empty text(s) from the training set")
        train = kept
    _check_rows(train, fmt, "training")
    if validation is not None:
        _check_rows(validation, fmt, "validation")
    if validation is None:
        train, validation, validation_source = hold_out(train, config.seed, source)
    missing = [c for c in columns if c not in validation.column_names]
    if missing:
        raise EffitrainError(
            f"validation data lacks column(s) {', '.join(missing)}; columns found: "
            f"{', '.join(validation.column_names)}"
        )
    if fmt == "text":
        validation = _drop_empty_texts(validation, columns[0])
    if len(validation) == 0:
        raise EffitrainError(f"the validation set ({validation_source}) is empty")
    completion_only = (
        config.completion_only_loss if config.completion_only_loss is not None else fmt != "text"
    )
    if completion_only and fmt == "text":
        raise EffitrainError(
            "--completion-only-loss needs prompt/completion, instruction or messages data; "
            f"this data is plain text ('{columns[0]}'); drop the option"
        )
    packing = config.packing if config.packing is not None else fmt == "text"
    return LMData(
        train=train,
        validation=validation,
        format=fmt,
        columns=columns,
        source=source,
        validation_source=validation_source,
        completion_only=completion_only,
        packing=packing,
        notes=notes,
    )


# --- tokenizing ---


def _with_eos(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else [*ids, eos]


def is_conversation(messages: Any) -> bool:
    """A chat: a non-empty list of messages with string roles and contents."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _messages(row: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """The conversation of one (checked) row as [{role, content}]; instructions converted."""
    if fmt == "instruction":
        extra = row.get("input")
        user = row["instruction"] + (
            f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else ""
        )
        return [
            {"role": "user", "content": user},
            {"role": "assistant", "content": row["output"]},
        ]
    return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]


def _chat_encoder(tokenizer: PreTrainedTokenizerBase, completion_only: bool, eos: int):
    """Encode one conversation: ids, labels and whether the assistant-only mask fell back.

    With completion_only, assistant turn i is the tokens between the rendering of messages[:i]
    with the generation prompt and the rendering of messages[:i+1]; both must be prefixes of
    the whole conversation's tokens, else (a template that rewrites earlier turns) the whole
    conversation is trained on.
    """

    def ids_of(messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(messages: list[dict[str, str]]) -> tuple[list[int], list[int], bool]:
        ids = ids_of(messages)
        ends_with_answer = messages[-1]["role"] == "assistant"
        labels = list(ids)
        fell_back = False
        if completion_only:
            labels = [IGNORE_INDEX] * len(ids)
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start, end = ids_of(messages[:i], True), ids_of(messages[: i + 1])
                if ids[: len(start)] != start or ids[: len(end)] != end or len(end) < len(start):
                    labels, fell_back = list(ids), True
                    break
                labels[len(start) : len(end)] = ids[len(start) : len(end)]
        if not ids or ids[-1] != eos:
            ids = [*ids, eos]
            trained = not completion_only or fell_back or ends_with_answer
            labels = [*labels, eos if trained else IGNORE_INDEX]
        return ids, labels, fell_back

    return encode


def _encoder(data: LMData, tokenizer: PreTrainedTokenizerBase):
    """The batched ``datasets.map`` function that tokenizes one split of ``data``."""
    eos = tokenizer.eos_token_id
    chat = _chat_encoder(tokenizer, data.completion_only, eos)

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if data.format == "text":
            texts = [t if isinstance(t, str) else "" for t in batch[data.columns[0]]]
            ids = [_with_eos(x, eos) for x in tokenizer(texts)["input_ids"]]
            return {"input_ids": ids, "labels": ids, "fell_back": [False] * len(ids)}
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "fell_back": []}
        if data.format == "prompt-completion":
            prompts = tokenizer(batch["prompt"])["input_ids"]
            completions = tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]
            for prompt, completion in zip(prompts, completions, strict=True):
                answer = [*completion, eos]
                mask = [IGNORE_INDEX] * len(prompt) if data.completion_only else prompt
                out["input_ids"].append(prompt + answer)
                out["labels"].append(mask + answer)
                out["fell_back"].append(False)
            return out
        rows = [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]
        for row in rows:
            ids, labels, fell_back = chat(_messages(row, data.format))
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["fell_back"].append(fell_back)
        return out

    return encode


def _chunk(batch: dict[str, list[Any]], max_length: int, split_long: bool) -> dict[str, list[Any]]:
    """Padding mode: cut each example to max_length (documents: into max_length pieces)."""
    out: dict[str, list[Any]] = {"input_ids": [], "labels": []}
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        starts = range(0, len(ids), max_length) if split_long else (0,)
        for start in starts:
            out["input_ids"].append(ids[start : start + max_length])
            out["labels"].append(labels[start : start + max_length])
    return out


def _trainable(batch: dict[str, list[Any]]) -> list[bool]:
    """Whether an example teaches anything: 2+ tokens and a label after the first token."""
    return [
        len(ids) >= 2 and any(label != IGNORE_INDEX for label in labels[1:])
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
    ]


def pack(
    input_ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, block_length: int
) -> dict[str, np.ndarray]:
    """Concatenated documents cut into blocks of ``block_length`` tokens.

    ``input_ids`` and ``labels`` are the documents' tokens end to end; document d is
    ``[offsets[d], offsets[d+1])``. The last partial block is dropped when a full one exists.
    Each block's ``position_ids`` restart at 0 at every document start and at the block start
    (a document cut by a block boundary continues as if new); a document starting inside a
    block after position 0 gets label -100 on its first token, so the previous document's last
    token is not trained to predict it.
    """
    import numpy as np

    total = len(input_ids)
    kept = total - total % block_length if total >= block_length else total
    if kept == 0:
        empty = np.zeros((0, block_length), dtype=np.int64)
        return {"input_ids": empty, "labels": empty, "position_ids": empty}
    index = np.arange(kept)
    doc_start = np.zeros(total, dtype=np.int64)
    starts = offsets[:-1][offsets[:-1] < total]
    doc_start[starts] = starts
    doc_start = np.maximum.accumulate(doc_start)[:kept]
    block_start = index - index % block_length
    positions = index - np.maximum(doc_start, block_start)
    labels = labels[:kept].copy()
    labels[(doc_start == index) & (block_start != index)] = IGNORE_INDEX
    width = min(block_length, kept)
    return {
        "input_ids": input_ids[:kept].reshape(-1, width),
        "labels": labels.reshape(-1, width),
        "position_ids": positions.reshape(-1, width),
    }


def _pack_split(split: datasets.Dataset, block_length: int) -> datasets.Dataset:
    """Pack a tokenized split (columns input_ids, labels) into a dataset of blocks."""
    import datasets
    import numpy as np

    table = split.with_format("arrow")[:]
    ids_column = table.column("input_ids").combine_chunks()
    labels_column = table.column("labels").combine_chunks()
    offsets = ids_column.offsets.to_numpy().astype(np.int64)
    packed = pack(
        ids_column.flatten().to_numpy().astype(np.int64),
        labels_column.flatten().to_numpy().astype(np.int64),
        offsets - offsets[0],
        block_length,
    )
    return datasets.Dataset.from_dict({k: list(v) for k, v in packed.items()})


def _too_short(split: str, data: LMData, max_length: int, encoded: datasets.Dataset) -> str:
    """Why no example of a tokenized split is left to train on, as one line."""
    lengths = [len(ids) for ids in encoded["input_ids"]]
    if max(lengths, default=0) < 2:
        return (
            f"every example of the {split} set is shorter than 2 tokens; a causal LM learns by "
            "predicting the next token, so it needs longer texts"
        )
    what = "completion" if data.format == "prompt-completion" else "assistant turn"
    if not any(label != IGNORE_INDEX for labels in encoded["labels"] for label in labels[1:]):
        return (
            f"no example of the {split} set has an {what} to train on with completion-only "
            "loss; add assistant turns or use --full-loss"
        )
    if data.packing:
        return (
            f"no {what} of the {split} set is left to train on once packed into blocks of "
            f"--max-length {max_length} tokens (packing drops the last partial block, which "
            f"held them); add {split} data or use --no-packing"
        )
    return (
        f"every {what} of the {split} set is cut off by --max-length {max_length}, so no "
        f"token is left to train on (the longest example has {max(lengths)} tokens); raise "
        "--max-length"
    )


def _has_target(packed: datasets.Dataset) -> bool:
    """Whether a packed block has a label after its first token (the model predicts token i + 1
    from token i, so the label at position 0 teaches nothing)."""
    import pyarrow.compute as pc

    labels = packed.with_format("arrow")[:].column("labels")
    targets = pc.list_flatten(pc.list_slice(labels, 1))
    return bool(pc.any(pc.not_equal(targets, IGNORE_INDEX)).as_py())


def tokenize_lm(
    data: LMData, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenize both splits into model inputs: packed blocks or truncated examples.

    Adds notes to ``data.notes`` (chat template fallback, full-loss fallbacks, dropped rows).
    ``max_length`` is capped by the tokenizer's ``model_max_length``.
    """
    if tokenizer.eos_token_id is None:
        raise EffitrainError(
            "the tokenizer has no end-of-sequence token, which separates documents; use a "
            "tokenizer with an eos_token"
        )
    max_length = capped_length(max_length, tokenizer.model_max_length, data.notes)
    if data.format in ("messages", "instruction") and tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
        data.notes.append(
            "the tokenizer has no chat template; using ChatML (<|im_start|>role ... "
            "<|im_end|>), saved with the tokenizer"
        )
    results = []
    for split_name, split in (("training", data.train), ("validation", data.validation)):
        encoded = split.map(
            _encoder(data, tokenizer),
            batched=True,
            remove_columns=split.column_names,
            desc=f"Tokenizing {split_name} set",
        )
        fell_back = sum(encoded["fell_back"])
        if fell_back:
            data.notes.append(
                f"{fell_back} of {len(encoded)} {split_name} conversations are trained on in "
                "full: the chat template does not render them turn by turn"
            )
        encoded = encoded.remove_columns("fell_back")
        if data.packing:
            tokenized = _pack_split(encoded.filter(_trainable, batched=True), max_length)
        else:
            tokenized = encoded.map(
                _chunk,
                batched=True,
                fn_kwargs={"max_length": max_length, "split_long": data.format == "text"},
            ).filter(_trainable, batched=True)
        if len(tokenized) == 0 or (data.packing and not _has_target(tokenized)):
            raise EffitrainError(_too_short(split_name, data, max_length, encoded))
        dropped = len(encoded) - len(tokenized)
        if not data.packing and dropped > 0:
            data.notes.append(
                f"dropped {dropped} {split_name} example(s) with nothing to train on (under 2 "
                f"tokens, or the answer cut off by --max-length {max_length})"
            )
        results.append(tokenized)
    return results[0], results[1]


# --- batching ---


class PackedCollator:
    """Stack packed blocks into int64 tensors (input_ids, labels, position_ids); no
    attention_mask, so the model builds its per-document mask from position_ids. Blocks
    shorter than the longest (or than a multiple of ``pad_to_multiple_of``) are padded at the
    end: pad tokens at positions 0, 1, ... form a separate document that nothing attends to,
    with label -100."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}
        batch: dict[str, Any] = {}
        for key in ("input_ids", "labels", "position_ids"):
            rows = []
            for feature in features:
                row = list(feature[key])
                extra = length - len(row)
                row += list(range(extra)) if key == "position_ids" else [fill[key]] * extra
                rows.append(row)
            batch[key] = torch.tensor(rows, dtype=torch.int64)
        return batch


def build_lm_dataloaders(
    data: LMData,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig,
    pad_to_multiple_of: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training and ordered evaluation loaders of packed blocks or padded examples.

    Batches hold int64 ``input_ids`` and ``labels``, plus ``position_ids`` when packed (call the
    model with ``use_cache=False``) or ``attention_mask`` when padded. A tokenizer without a pad
    token gets its eos token as pad token (pads are never trained on).
    """
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        data.notes.append("the tokenizer has no pad token; using its eos token for padding")
    train, validation = tokenize_lm(data, tokenizer, config.max_length)
    collator = lm_collator(data.packing, tokenizer.pad_token_id, tokenizer, pad_to_multiple_of)
    return loaders(train, validation, collator, config)


def lm_collator(
    packed: bool,
    pad_token_id: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    pad_to_multiple_of: int | None = None,
) -> WithDocumentLengths:
    """The run's collator: packed blocks (:class:`PackedCollator`) or padded examples
    (transformers' ``DataCollatorForSeq2Seq`` with ``tokenizer``, labels padded with -100; right
    padding with ``pad_token_id`` without one), each batch with its
    rows' document lengths (``effitrain.tasks.document_attention``)."""
    from transformers import DataCollatorForSeq2Seq

    if packed:
        return WithDocumentLengths(PackedCollator(pad_token_id, pad_to_multiple_of))
    if tokenizer is None:  # an estimate's model known by its config alone: padded as below
        return WithDocumentLengths(functools.partial(_padded, pad_token_id))
    return WithDocumentLengths(
        DataCollatorForSeq2Seq(
            tokenizer,
            padding=True,
            pad_to_multiple_of=pad_to_multiple_of,
            label_pad_token_id=IGNORE_INDEX,
        )
    )
