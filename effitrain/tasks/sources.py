"""Where a task's raw data comes from: the built-in demo, a hub dataset, local files or folders.

Both tasks load through here (:mod:`.classification` and :mod:`.lm_data` add their own columns,
formats and checks); :func:`loaders` makes the two dataloaders the same way for both.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError, first_line
from effitrain.models import is_offline

if TYPE_CHECKING:
    import datasets
    from torch.utils.data import DataLoader

    from effitrain.config import TrainConfig

LABEL_COLUMN_CANDIDATES = ("label", "labels", "label_id", "class", "target")
"""Label columns, tried in order (classification; causal-LM data with one is classified)."""
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


def load_local_file(
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
        with _datasets_logs_off():
            return datasets.load_dataset(
                builder,
                data_files={split: str(file)},
                split=split,
                **BUILDER_OPTIONS.get(suffix, {}),
            )
    except Exception as exc:  # datasets raises many types for malformed files
        if "corresponds to no data" in str(exc):  # datasets' words for a file without rows
            raise EffitrainError(f"dataset file '{path}' is empty (no rows)") from exc
        reason = (_json_error(file) if builder == "json" else None) or _root_message(exc)
        raise EffitrainError(f"cannot read '{path}' as {builder}: {reason}") from exc


@contextmanager
def _datasets_logs_off() -> Iterator[None]:
    """datasets logs a file's parse error before raising it; the raised error is reported (with
    the file, the line and the reason), so its log line would only say it twice."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _root_message(exc: BaseException) -> str:
    """The first line of the innermost error in ``exc``'s chain: datasets wraps the parser's
    error (which names the row and the reason) in its own 'An error occurred while generating
    the dataset'."""
    chain = [exc]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    return first_line(next((e for e in reversed(chain) if str(e).strip()), exc))


def _folder_json_error(folder: Path) -> str | None:
    """The first JSON or JSON Lines file of ``folder`` that does not parse, and where."""
    for file in sorted(folder.rglob("*")):
        if file.suffix.lower() in (".json", ".jsonl") and file.is_file():
            found = _json_error(file)
            if found:
                return f"{file.relative_to(folder)}: {found}"
    return None


def _json_error(file: Path) -> str | None:
    """Where and why a JSON or JSON Lines file does not parse, by Python's own parser: the
    line and column (pyarrow's reader counts rows per block of the file, not lines), or None
    when it parses (the error is then in its contents: datasets' message says what)."""
    with file.open(encoding="utf-8", errors="replace") as handle:
        lines = ((n, line) for n, line in enumerate(handle, start=1) if line.strip())
        first = next(lines, (0, ""))
        if file.suffix.lower() == ".jsonl" or _parses(first[1]):  # JSON Lines: a row per line
            for number, line in itertools.chain([first], lines):
                try:
                    json.loads(line)
                except ValueError as exc:
                    return _where(exc, number)
            return None
    try:
        json.loads(file.read_text(encoding="utf-8", errors="replace"))
    except ValueError as exc:
        return _where(exc)
    return None


def _parses(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _where(exc: ValueError, line: int | None = None) -> str:
    """``line 7, column 22: Expecting ',' delimiter``."""
    if isinstance(exc, json.JSONDecodeError):
        return f"line {line or exc.lineno}, column {exc.colno}: {exc.msg}"
    return f"line {line}: {first_line(exc)}" if line else first_line(exc)


def load_folder(name: str, config: TrainConfig, formats: dict[str, str]) -> dict[str, Any]:
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
            with _datasets_logs_off():
                loaded = datasets.load_dataset(str(path), config.dataset_config, **options)
    except Exception as exc:
        reason = _folder_json_error(path) or _root_message(exc)
        raise EffitrainError(f"cannot read dataset folder '{name}': {reason}") from exc
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def load_splits(
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
        return {"train": load_local_file(config.train_file, "train", formats)}, config.train_file
    name = config.dataset
    if name == "demo":
        if demo is not None:
            splits, description = demo()
            return dict(splits), description
        from effitrain.demo import build_demo_dataset

        return dict(build_demo_dataset()), "built-in demo (MRPC-shaped sentence pairs)"
    path = Path(name).expanduser()
    if path.is_file():
        return {"train": load_local_file(name, "train", formats)}, name
    if path.is_dir():
        return load_folder(name, config, formats), name
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


def train_and_validation(
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
        validation = load_local_file(config.validation_file, "validation", formats)
        return splits["train"], validation, config.validation_file
    name = next((s for s in VALIDATION_SPLITS if s in splits), None)
    if name is None:
        return splits["train"], None, ""
    return splits["train"], splits[name], f"split '{name}'"


def hold_out(
    train: datasets.Dataset, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset, str]:
    """Split HELD_OUT_FRACTION of train off, seeded, as the validation set."""
    if len(train) < 2:
        raise EffitrainError(f"the training set of {source} is too small to hold out a split")
    held = train.train_test_split(test_size=HELD_OUT_FRACTION, seed=seed)
    return held["train"], held["test"], f"{HELD_OUT_FRACTION:.0%} held out of train"


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
