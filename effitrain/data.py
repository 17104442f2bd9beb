"""Datasets: load (built-in demo, hub id, local files), find columns and labels, tokenize, batch.

``load_data`` returns raw splits plus what the model needs to know (number and names of labels);
``build_dataloaders`` tokenizes with the model's tokenizer and pads each batch dynamically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError, first_line
from effitrain.models import is_offline

if TYPE_CHECKING:
    from collections.abc import Callable

    import datasets
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.config import TrainConfig

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
LABEL_COLUMN_CANDIDATES = ("label", "labels", "label_id", "class", "target")
VALIDATION_SPLITS = ("validation", "validation_matched", "dev", "valid", "test")
LOCAL_FORMATS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
BUILDER_OPTIONS: dict[str, dict[str, Any]] = {
    ".tsv": {"delimiter": "\t"},
    # Plain text (causal-lm): blank-line-separated paragraphs are the documents.
    ".txt": {"sample_by": "paragraph"},
}
"""Options given to the datasets builder for a file of this suffix."""
HELD_OUT_FRACTION = 0.1


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

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def _load_local_file(
    path: str, split: str, formats: dict[str, str] = LOCAL_FORMATS
) -> datasets.Dataset:
    """One split from a local file, read by the datasets builder its suffix names in ``formats``."""
    import datasets

    file = Path(path).expanduser()
    if not file.exists():
        raise EffitrainError(f"dataset file not found: {path}")
    if file.is_dir():
        raise EffitrainError(f"{path} is a folder; give a file ({', '.join(formats)})")
    suffix = file.suffix.lower()
    builder = formats.get(suffix)
    if builder is None:
        raise EffitrainError(
            f"cannot read '{path}': unknown file type '{file.suffix}'; use one of {', '.join(formats)}"
        )
    if file.stat().st_size == 0:
        raise EffitrainError(f"dataset file '{path}' is empty")
    try:
        return datasets.load_dataset(
            builder, data_files={split: str(file)}, split=split, **BUILDER_OPTIONS.get(suffix, {})
        )
    except Exception as exc:  # datasets raises many types for malformed files
        if "corresponds to no data" in str(exc):  # datasets' words for a file without rows
            raise EffitrainError(f"dataset file '{path}' is empty (no rows)") from exc
        raise EffitrainError(f"cannot read '{path}' as {builder}: {first_line(exc)}") from exc


def _load_folder(name: str, config: TrainConfig, formats: dict[str, str]) -> dict[str, Any]:
    """A folder saved with ``save_to_disk``, or a folder of data files (datasets infers the
    builder and the splits from the file names: train.jsonl, validation.jsonl, ...)."""
    import datasets

    path = Path(name).expanduser()
    try:
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            loaded = datasets.load_from_disk(str(path))
        else:
            # The text builder's options only for a folder of .txt files (json rejects them).
            suffixes = {f.suffix.lower() for f in path.rglob("*") if f.is_file()}
            txt = ".txt" in formats and ".txt" in suffixes
            options = BUILDER_OPTIONS[".txt"] if txt else {}
            loaded = datasets.load_dataset(str(path), config.dataset_config, **options)
    except Exception as exc:
        raise EffitrainError(f"cannot read dataset folder '{name}': {first_line(exc)}") from exc
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _load_splits(
    config: TrainConfig,
    demo: Callable[[], tuple[Any, str]] | None = None,
    formats: dict[str, str] = LOCAL_FORMATS,
) -> tuple[dict[str, datasets.Dataset], str]:
    """The raw splits by name, and a short description of where they came from.

    ``demo`` builds the splits of ``--dataset demo`` (the classification demo by default);
    ``formats`` are the local file types accepted (suffix -> datasets builder).
    """
    import datasets

    if config.train_file is not None:
        return {"train": _load_local_file(config.train_file, "train", formats)}, config.train_file
    name = config.dataset
    if name == "demo":
        if demo is not None:
            splits, description = demo()
            return dict(splits), description
        from effitrain.demo import build_demo_dataset

        return dict(build_demo_dataset()), "built-in demo (MRPC-shaped sentence pairs)"
    path = Path(name).expanduser()
    if path.is_file():
        return {"train": _load_local_file(name, "train", formats)}, name
    if path.is_dir():
        return _load_folder(name, config, formats), name
    if name.startswith((".", "/", "~")) or Path(name).suffix.lower() in formats:
        raise EffitrainError(f"dataset not found: {name} (no such file or folder)")
    try:
        loaded = datasets.load_dataset(name, config.dataset_config)
    except Exception as exc:
        if is_offline():
            reason = "not a local file or folder, and the hub is offline (HF_DATASETS_OFFLINE=1)"
        else:
            reason = first_line(exc)
        raise EffitrainError(f"cannot load dataset '{name}': {reason}") from exc
    source = name + (f"/{config.dataset_config}" if config.dataset_config else "")
    return dict(loaded), source


def _train_and_validation(
    config: TrainConfig,
    splits: dict[str, datasets.Dataset],
    source: str,
    formats: dict[str, str] = LOCAL_FORMATS,
) -> tuple[datasets.Dataset, datasets.Dataset | None, str]:
    """The training split, and the validation data: ``--validation-file``, else the first of
    VALIDATION_SPLITS the dataset has, else None (the caller holds some of train out)."""
    if "train" not in splits:
        raise EffitrainError(f"dataset {source} has no 'train' split (splits: {', '.join(splits)})")
    if config.validation_file is not None:
        validation = _load_local_file(config.validation_file, "validation", formats)
        return splits["train"], validation, config.validation_file
    name = next((s for s in VALIDATION_SPLITS if s in splits), None)
    if name is None:
        return splits["train"], None, ""
    return splits["train"], splits[name], f"split '{name}'"


def _hold_out(
    train: datasets.Dataset, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset, str]:
    """Split HELD_OUT_FRACTION of train off, seeded, as the validation set."""
    if len(train) < 2:
        raise EffitrainError(f"the training set of {source} is too small to hold out a split")
    held = train.train_test_split(test_size=HELD_OUT_FRACTION, seed=seed)
    return held["train"], held["test"], f"{HELD_OUT_FRACTION:.0%} held out of train"


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
        "Name them with --text-columns COL or --text-columns COL1,COL2"
    )


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
    splits, source = _load_splits(config)
    train, validation, validation_source = _train_and_validation(config, splits, source)
    if len(train) == 0:
        raise EffitrainError(f"the training set of {source} is empty")
    columns = list(train.column_names)
    text_columns = _pick_text_columns(columns, config)
    label_column = _pick_label_column(columns, config)
    if text_columns and label_column in text_columns:
        raise EffitrainError(f"column '{label_column}' cannot be both a text and the label column")
    if validation is None:
        train, validation, validation_source = _hold_out(train, config.seed, source)
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
    )


def tokenize(
    data: LoadedData, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenize both splits (truncating to ``max_length``); keep only model inputs and labels.

    ``max_length`` is capped by the tokenizer's ``model_max_length``: longer inputs would index
    past the model's position embeddings.
    """
    max_length = min(max_length, tokenizer.model_max_length)

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


def loaders(
    train: Any, validation: Any, collator: Any, config: TrainConfig
) -> tuple[DataLoader, DataLoader]:
    """A shuffled training loader and an ordered evaluation loader (both tasks).

    The training loader has its own seeded generator so that data order and, after a resume,
    everything drawn from it are reproducible.
    """
    import torch
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(config.seed)
    train_loader = DataLoader(
        train, batch_size=config.batch_size, shuffle=True, collate_fn=collator, generator=generator
    )
    eval_loader = DataLoader(
        validation,
        batch_size=config.eval_batch_size or 2 * config.batch_size,
        shuffle=False,
        collate_fn=collator,
    )
    return train_loader, eval_loader


def steps_per_epoch(num_batches: int, grad_accum: int) -> int:
    """Optimizer steps in one pass over ``num_batches`` micro-batches (the last step may be short)."""
    return math.ceil(num_batches / grad_accum)
