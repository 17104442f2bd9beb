"""Sequence classification: labelled texts (one or two columns), a ``*ForSequenceClassification``
model sized from the labels, accuracy and F1.

:func:`load_data` finds the text and label columns and maps labels to ids; :func:`build_dataloaders`
tokenizes with the model's tokenizer and pads each batch dynamically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import effitrain.models as models
from effitrain.config import option
from effitrain.errors import EffitrainError
from effitrain.tasks.base import CAUSAL_LM_OPTIONS, SEQUENCE_CLASSIFICATION, Task
from effitrain.tasks.sources import (
    LABEL_COLUMN_CANDIDATES,
    hold_out,
    load_splits,
    loaders,
    train_and_validation,
)

if TYPE_CHECKING:
    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from effitrain.config import TrainConfig
    from effitrain.parts import RunParts

# Tried in order; the first whose columns all exist wins.
TEXT_COLUMN_CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("question", "sentence"),
    ("question", "passage"),
    ("sentence",),
    ("text",),
    ("review",),
    ("content",),
    ("document",),
)


@dataclass
class LoadedData:
    """Raw train/validation splits with the columns and labels resolved."""

    train: datasets.Dataset
    validation: datasets.Dataset
    text_columns: tuple[str, ...]
    label_column: str
    label_names: list[str]
    source: str
    validation_source: str
    notes: list[str] = field(default_factory=list)
    """Things worth telling the user (files of a folder skipped as not data)."""

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def _pick_text_columns(columns: list[str], config: TrainConfig) -> tuple[str, ...]:
    if config.text_columns:
        missing = [c for c in config.text_columns if c not in columns]
        if missing:
            raise EffitrainError(
                f"--text-columns {', '.join(missing)} not in the dataset; columns found: "
                f"{', '.join(columns)}"
            )
        return tuple(config.text_columns)
    for candidate in TEXT_COLUMN_CANDIDATES:
        if all(c in columns for c in candidate):
            return candidate
    raise EffitrainError(
        f"no usable text column; columns found: {', '.join(columns)}. "
        + (
            _other_task_hint(columns)
            or "Name them with --text-columns COL or --text-columns COL1,COL2"
        )
    )


def _other_task_hint(columns: list[str]) -> str | None:
    """Where the columns are another task's data (a chat, prompt/completion, preference pairs),
    the ``--task`` that reads them; None otherwise."""
    from effitrain.tasks.lm_data import FORMAT_COLUMNS
    from effitrain.tasks.preference_data import ANSWERS

    if all(c in columns for c in ANSWERS):
        return "These are preference pairs: train on them with --task preference"
    for name, needed in FORMAT_COLUMNS:
        if name != "text" and all(c in columns for c in needed):
            return f"{'+'.join(needed)} is causal-LM data: train on it with --task causal-lm"
    return None


def _pick_label_column(columns: list[str], config: TrainConfig) -> str:
    if config.label_column:
        if config.label_column not in columns:
            raise EffitrainError(
                f"--label-column {config.label_column} not in the dataset; columns found: "
                f"{', '.join(columns)}"
            )
        return config.label_column
    for candidate in LABEL_COLUMN_CANDIDATES:
        if candidate in columns:
            return candidate
    raise EffitrainError(
        f"no label column; columns found: {', '.join(columns)}. Name it with --label-column COL"
    )


def _label_values(dataset: datasets.Dataset, column: str) -> list[Any]:
    return dataset.unique(column)


def _resolve_labels(
    train: datasets.Dataset, validation: datasets.Dataset, column: str
) -> tuple[datasets.Dataset, datasets.Dataset, list[str]]:
    """Map labels to ids 0..K-1 and check both splits fit; return the label names."""
    import datasets

    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
    else:
        values = [v for v in _label_values(train, column) if v is not None]
        if values and all(isinstance(v, str) for v in values):
            names = sorted(values)
            unseen = sorted(
                {v for v in _label_values(validation, column) if v is not None} - set(names)
            )
            if unseen:
                raise EffitrainError(
                    f"validation labels {unseen[:5]} never occur in the training set "
                    f"(labels seen: {names[:10]})"
                )
            # ClassLabel maps the names to ids 0..K-1 (sorted, so the order is reproducible).
            label_feature = datasets.ClassLabel(names=names)
            train = train.cast_column(column, label_feature)
            validation = validation.cast_column(column, label_feature)
        elif values and all(isinstance(v, (int, float)) and float(v).is_integer() for v in values):
            names = [str(i) for i in range(int(max(values)) + 1)]
            if any(isinstance(v, float) for v in values):  # 0.0/1.0 read from a csv
                train = train.cast_column(column, datasets.Value("int64"))
                validation = validation.cast_column(column, datasets.Value("int64"))
        else:
            sample = values[:5]
            raise EffitrainError(
                f"label column '{column}' must hold class ids or class names, found {sample}; "
                "effitrain trains classifiers"
            )
    num_labels = len(names)
    for split_name, split in (("training", train), ("validation", validation)):
        bad = [v for v in _label_values(split, column) if v is None or not 0 <= v < num_labels]
        if bad:
            shown = "(empty)" if None in bad else min(bad)
            raise EffitrainError(
                f"{split_name} label {shown} is out of range for a model with {num_labels} "
                f"labels (0..{num_labels - 1}); fix the '{column}' column or drop those rows"
            )
    return train, validation, names


def load_data(config: TrainConfig) -> LoadedData:
    """Load the training and validation splits and resolve text columns and labels.

    Raises:
        EffitrainError: missing files, no usable columns, bad labels, or an empty training set.
    """
    splits, source, notes = load_splits(config)
    train, validation, validation_source = train_and_validation(config, splits, source)
    if len(train) == 0:
        raise EffitrainError(f"the training set of {source} is empty")
    columns = list(train.column_names)
    text_columns = _pick_text_columns(columns, config)
    label_column = _pick_label_column(columns, config)
    if text_columns and label_column in text_columns:
        raise EffitrainError(f"column '{label_column}' cannot be both a text and the label column")
    if validation is None:
        train, validation, validation_source = hold_out(train, config.seed, source)
    missing = [c for c in (*text_columns, label_column) if c not in validation.column_names]
    if missing:
        raise EffitrainError(
            f"validation data lacks column(s) {', '.join(missing)}; columns found: "
            f"{', '.join(validation.column_names)}"
        )
    train, validation, names = _resolve_labels(train, validation, label_column)
    if len(names) < 2:
        raise EffitrainError(
            f"label column '{label_column}' has a single class ({names}); a classifier needs two"
        )
    return LoadedData(
        train=train,
        validation=validation,
        text_columns=text_columns,
        label_column=label_column,
        label_names=names,
        source=source,
        validation_source=validation_source,
        notes=notes,
    )


def tokenize(
    data: LoadedData, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenize both splits (truncating to ``max_length``); keep only model inputs and labels.

    ``max_length`` is capped by the tokenizer's ``model_max_length``: longer inputs would index
    past the model's position embeddings.
    """
    max_length = models.capped_length(max_length, tokenizer.model_max_length, data.notes)

    def encode(batch: dict[str, list[Any]]) -> dict[str, Any]:
        texts = [["" if t is None else str(t) for t in batch[c]] for c in data.text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        encoded["labels"] = batch[data.label_column]
        return encoded

    def run(split: datasets.Dataset) -> datasets.Dataset:
        return split.map(encode, batched=True, remove_columns=split.column_names)

    return run(data.train), run(data.validation)


def build_dataloaders(
    data: LoadedData,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig,
    pad_to_multiple_of: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training and ordered evaluation loaders with dynamic padding."""
    from transformers import DataCollatorWithPadding

    train, validation = tokenize(data, tokenizer, config.max_length)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    return loaders(train, validation, collator, config)


def evaluate(run: RunParts) -> dict[str, Any]:
    """Loss, accuracy and F1 over the whole validation set, each example counted once.

    ``gather_for_metrics`` drops the samples that the last batch repeats to even out processes.
    F1 is binary for two labels and macro-averaged otherwise (:func:`scores`).
    """
    import torch
    import torch.nn.functional as F

    accelerator = run.accelerator
    predictions, references, losses = [], [], []
    for batch in run.eval_loader:
        with torch.no_grad():
            logits = run.model(**batch).logits
        per_example_loss = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        preds, refs, loss = accelerator.gather_for_metrics(
            (logits.argmax(dim=-1), batch["labels"], per_example_loss)
        )
        predictions.append(preds.cpu())
        references.append(refs.cpu())
        losses.append(loss.cpu())
    y_true = torch.cat(references)
    return {
        "loss": float(torch.cat(losses).mean()),
        **scores(torch.cat(predictions), y_true, run.data.num_labels),
        "examples": int(len(y_true)),
    }


def scores(y_pred: torch.Tensor, y_true: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 as scikit-learn's ``accuracy_score`` and ``f1_score(average="binary"
    for two labels, else "macro", zero_division=0)`` give them (a test compares): importing
    scikit-learn for two sums cost each run most of a second.

    Macro F1 averages the labels that occur in either tensor; a label's F1 is 2TP / (2TP + FP +
    FN), 0 where nothing was predicted or true. Binary F1 is label 1's.
    """
    import torch

    def f1(label: int) -> float:
        predicted, true = y_pred == label, y_true == label
        both = int((predicted & true).sum())
        either = int(predicted.sum()) + int(true.sum())
        return 2 * both / either if either else 0.0

    if num_labels == 2:
        f1_score = f1(1)
    else:
        labels = torch.unique(torch.cat([y_true, y_pred])).tolist()
        f1_score = sum(f1(label) for label in labels) / len(labels) if labels else 0.0
    accuracy = int((y_pred == y_true).sum()) / len(y_true) if len(y_true) else 0.0
    return {"accuracy": accuracy, "f1": f1_score}


class ClassificationTask(Task):
    """Sequence classification: ``*ForSequenceClassification`` with a head sized from the labels."""

    name = SEQUENCE_CLASSIFICATION
    speed_unit = "samples"

    def check_options(self, config: TrainConfig) -> None:
        given = [option(name) for name in CAUSAL_LM_OPTIONS if getattr(config, name) is not None]
        if given:
            raise EffitrainError(
                f"{given[0]} needs --task causal-lm (this run is {self.name}); drop it"
            )

    def load_data(self, config: TrainConfig) -> LoadedData:
        return load_data(config)

    def load_model(
        self, config: TrainConfig, data: LoadedData, tokenizer: Any, options: models.LoadOptions
    ) -> PreTrainedModel:
        return models.load_model(config.model, data.label_names, tokenizer, options, data.notes)

    def model_from_config(
        self, config: TrainConfig, data: LoadedData, tokenizer: Any
    ) -> PreTrainedModel:
        return models.model_from_config(
            config.model, tokenizer, causal_lm=False, label_names=data.label_names
        )

    def dataloaders(
        self,
        config: TrainConfig,
        data: LoadedData,
        tokenizer: Any,
        pad_to_multiple_of: int | None,
    ) -> tuple[DataLoader[Any], DataLoader[Any]]:
        return build_dataloaders(data, tokenizer, config, pad_to_multiple_of)

    def evaluate(self, run: RunParts) -> dict[str, Any]:
        return evaluate(run)

    def data_line(self, data: LoadedData, train_loader: Any) -> str:
        columns = " + ".join(data.text_columns)
        return f"text {columns}, label {data.label_column} ({data.num_labels} classes)"

    def fake_batch(
        self, tokenizer: Any, batch_size: int, length: int, packed: bool = False
    ) -> dict[str, torch.Tensor]:
        import torch

        batch = super().fake_batch(tokenizer, batch_size, length)
        batch["labels"] = torch.zeros(batch_size, dtype=torch.long)
        return batch
