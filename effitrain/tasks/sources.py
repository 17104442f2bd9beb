"""Where a task's raw data comes from: the built-in demo, a hub dataset, local files or folders.

Both tasks load through here (:mod:`.classification` and :mod:`.lm_data` add their own columns,
formats and checks); :func:`loaders` makes the two dataloaders the same way for both.
"""

from __future__ import annotations

import codecs
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


def _existing(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.exists():
        raise EffitrainError(f"dataset file not found: {path}")
    return file


def check_files_exist(config: TrainConfig) -> None:
    """``--train-file`` and ``--validation-file`` exist: checked before anything is imported
    or built (a missing one was found seconds later, when the data loaded after the model)."""
    for path in (config.train_file, config.validation_file):
        if path is not None:
            _existing(path)


def load_local_file(
    path: str, split: str, formats: dict[str, str] = LOCAL_FORMATS
) -> datasets.Dataset:
    """One split from a local file, read by the datasets builder its suffix names in ``formats``."""
    import datasets

    file = _existing(path)
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
    if builder != "parquet":
        not_utf8 = _not_utf8(file)
        if not_utf8:
            raise EffitrainError(f"cannot read '{path}': {not_utf8}")
    try:
        with _datasets_logs_off():
            loaded = datasets.load_dataset(
                builder,
                data_files={split: str(file)},
                split=split,
                **BUILDER_OPTIONS.get(suffix, {}),
            )
    except Exception as exc:  # datasets raises many types for malformed files
        if "corresponds to no data" in str(exc):  # datasets' words for a file without rows
            raise EffitrainError(f"dataset file '{path}' is empty (no rows)") from exc
        reason = (
            (_json_error(file) or _rows_differ(file)) if builder == "json" else None
        ) or _root_message(exc)
        raise EffitrainError(f"cannot read '{path}' as {builder}: {reason}") from exc
    if builder == "json" and _rows_may_differ(loaded):
        problem = _rows_differ(file)
        if problem:
            raise EffitrainError(f"cannot read '{path}': {problem}")
    return loaded


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


def _not_utf8(file: Path, chunk_bytes: int = 1 << 24) -> str | None:
    """Where a text data file is not UTF-8 (``line 6, column 19: byte 0xe9 is not UTF-8``), or
    None. pyarrow's JSON reader keeps such bytes and a later step fails on them without a
    place, so the file is checked first (in chunks, at the decoder's speed)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with file.open("rb") as handle:
        offset = 0
        while True:
            chunk = handle.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                # exc.start counts from what the decoder held back, at most 3 bytes earlier
                held = len(exc.object) - len(chunk)
                bad = offset - held + exc.start
                handle.seek(0)
                head = handle.read(bad)
                line = head.count(b"\n") + 1
                column = bad - (head.rfind(b"\n") + 1) + 1
                return (
                    f"line {line}, column {column}: byte 0x{exc.object[exc.start]:02x} is not "
                    "UTF-8; save the file as UTF-8"
                )
            if not chunk:
                return None
            offset += len(chunk)


def _root_message(exc: BaseException) -> str:
    """The first line of the innermost error in ``exc``'s chain: datasets wraps the parser's
    error (which names the row and the reason) in its own 'An error occurred while generating
    the dataset'."""
    chain = [exc]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    return first_line(next((e for e in reversed(chain) if str(e).strip()), exc))


def _folder_json_error(folder: Path, files: list[Path]) -> str | None:
    """The first JSON or JSON Lines file among ``files`` (in ``folder``) that does not parse,
    or whose rows differ (:func:`_rows_differ`), and where."""
    for file in files:
        if file.suffix.lower() in (".json", ".jsonl"):
            found = _json_error(file) or _rows_differ(file)
            if found:
                return f"{file.relative_to(folder)}: {found}"
    return None


class _Unparsable(ValueError):
    """Where and why a JSON file does not parse: ``line 7, column 22: Expecting ',' delimiter``."""


def _json_rows(file: Path) -> Iterator[tuple[str, Any]]:
    """The rows of a JSON Lines file, each with its place (``line 7``), or the items of a JSON
    document that is a list (``row 7``), read by Python's own parser (pyarrow's reader counts
    rows per block of the file, not lines).

    Raises:
        _Unparsable: where and why the file does not parse.
    """
    with file.open(encoding="utf-8", errors="replace") as handle:
        lines = ((n, line) for n, line in enumerate(handle, start=1) if line.strip())
        first = next(lines, (0, ""))
        if file.suffix.lower() == ".jsonl" or _parses(first[1]):  # JSON Lines: a row per line
            for number, line in itertools.chain([first], lines):
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise _Unparsable(_where(exc, number)) from exc
                yield f"line {number}", row
            return
    try:
        document = json.loads(file.read_text(encoding="utf-8", errors="replace"))
    except ValueError as exc:
        raise _Unparsable(_where(exc)) from exc
    for number, row in enumerate(document if isinstance(document, list) else [], start=1):
        yield f"row {number}", row


def _json_error(file: Path) -> str | None:
    """Where and why a JSON or JSON Lines file does not parse, or None when it parses (the
    error is then in its contents: :func:`_rows_differ` or datasets' message says what)."""
    try:
        for _ in _json_rows(file):
            pass
    except _Unparsable as exc:
        return str(exc)
    return None


def _rows_may_differ(dataset: datasets.Dataset) -> bool:
    """Whether the rows a JSON file was read into may differ in keys or value types (cheap: no
    row is read). A missing key reads as null; datasets 4 reads a column whose values mix
    types as ``Json``, where datasets 3 fails to load the file."""
    import datasets

    mixed = getattr(datasets, "Json", None)
    return any(
        mixed is not None and isinstance(f, mixed) for f in dataset.features.values()
    ) or any(column.null_count for column in dataset.data.columns)


_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _json_type(value: Any) -> tuple[str, str]:
    """A value's JSON kind (an integer and a number are one kind: a column reads them as
    floats) and its name for a message."""
    name = _JSON_TYPES.get(type(value)) or ("a list" if isinstance(value, list) else "an object")
    return ("a number" if name == "an integer" else name), name


def _rows_differ(file: Path) -> str | None:
    """The first row of a JSON or JSON Lines file whose keys differ from the first row's, or
    whose value has another type than the column's first value: where, and both sides. A
    missing key would read as an empty value, and a column of mixed types would fail later
    with pyarrow's words. None when every row agrees (or the file is not a list of objects)."""
    first: tuple[str, list[str]] | None = None
    kinds: dict[str, tuple[str, str, str]] = {}  # key -> (kind, name, where first seen)
    try:
        for where, row in _json_rows(file):
            if not isinstance(row, dict):
                return None
            if first is None:
                first = (where, list(row))
            elif set(row) != set(first[1]):
                return (
                    f"{where} has keys {', '.join(row) or '(none)'} but {first[0]} has "
                    f"{', '.join(first[1])}; every row needs the same keys"
                )
            for key, value in row.items():
                if value is None:
                    continue
                kind, name = _json_type(value)
                seen = kinds.setdefault(key, (kind, name, where))
                if seen[0] != kind:
                    shown = json.dumps(value)
                    shown = shown if len(shown) <= 20 else shown[:17] + "..."
                    return (
                        f"'{key}' is {name} ({shown}) on {where} but {seen[1]} on {seen[2]}; "
                        "every value of a column needs one type"
                    )
    except _Unparsable:
        return None
    return None


def _parses(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _where(exc: ValueError, line: int | None = None) -> str:
    """``line 7, column 22: Expecting ',' delimiter``."""
    if isinstance(exc, json.JSONDecodeError):
        where = f"line {line or exc.lineno}, column {exc.colno}"
        if exc.msg.startswith("Invalid control character"):
            # Python's message ends at the character; a raw NUL would also cut the terminal's line
            character = exc.doc[exc.pos] if exc.pos < len(exc.doc) else ""
            return (
                f"{where}: raw control character {character!r} inside a string; JSON needs it "
                f"escaped (\\u{ord(character or chr(0)):04x})"
            )
        return f"{where}: {exc.msg}"
    return f"line {line}: {first_line(exc)}" if line else first_line(exc)


def load_folder(
    name: str, config: TrainConfig, formats: dict[str, str]
) -> tuple[dict[str, Any], list[str]]:
    """A folder saved with ``save_to_disk``, or a folder of data files of one format (datasets
    infers the splits from the file names: train.jsonl, validation.jsonl, ...); and the notes
    on the files skipped as not data.

    Raises:
        EffitrainError: no data file, data files of several formats, or one that cannot be read.
    """
    import datasets

    path = Path(name).expanduser().resolve()  # datasets names the files by absolute paths
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise EffitrainError(
                f"cannot read dataset folder '{name}': {_root_message(exc)}"
            ) from exc
        return ({"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)), []
    data_files, notes = _folder_data_files(path, name, formats)
    suffix = next(Path(f).suffix.lower() for files in data_files.values() for f in files)
    if formats[suffix] != "parquet":
        for file in sorted({Path(f) for files in data_files.values() for f in files}):
            not_utf8 = _not_utf8(file)
            if not_utf8:
                raise EffitrainError(
                    f"cannot read dataset folder '{name}': {file.relative_to(path)}: {not_utf8}"
                )
    try:
        with _datasets_logs_off():
            loaded = datasets.load_dataset(
                str(path),
                config.dataset_config,
                data_files=data_files,
                **BUILDER_OPTIONS.get(suffix, {}),
            )
    except Exception as exc:
        files = [Path(f) for split_files in data_files.values() for f in split_files]
        reason = _folder_json_error(path, files) or _root_message(exc)
        raise EffitrainError(f"cannot read dataset folder '{name}': {reason}") from exc
    if formats[suffix] == "json":
        for split, dataset in loaded.items():
            if _rows_may_differ(dataset):
                files = [Path(f) for f in data_files[str(split)]]
                problem = _folder_json_error(path, files)
                if problem:
                    raise EffitrainError(f"cannot read dataset folder '{name}': {problem}")
    return dict(loaded), notes


def _folder_data_files(
    path: Path, name: str, formats: dict[str, str]
) -> tuple[dict[str, list[str]], list[str]]:
    """The data files of a folder by split, as datasets finds them (hidden files and its own
    metadata files left out), if they are all of one format; a note per other file type.

    Several formats are refused rather than one picked: datasets would read the most common
    one and drop the other files' rows without a word.
    """
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except Exception:  # datasets' EmptyDatasetError: no file at all
        found = DataFilesDict()
    by_split = {str(split): [Path(f) for f in files] for split, files in found.items()}
    data: dict[tuple[str, str], list[Path]] = {}
    other: dict[str, list[Path]] = {}
    for file in sorted({f for files in by_split.values() for f in files}):
        suffix = file.suffix.lower()
        if suffix in formats:
            # One format: one builder with one set of options (.json and .jsonl are one).
            key = (formats[suffix], repr(BUILDER_OPTIONS.get(suffix, {})))
            data.setdefault(key, []).append(file)
        else:
            other.setdefault(suffix, []).append(file)
    if not data:
        held = ", ".join(_files(path, files) for files in other.values()) or "no file"
        raise EffitrainError(
            f"dataset folder '{name}' holds no data file (found {held}); effitrain reads "
            f"{', '.join(formats)}"
        )
    if len(data) > 1:
        example = next(iter(data.values()))[0].relative_to(path)
        raise EffitrainError(
            f"dataset folder '{name}' holds several data formats: "
            f"{', '.join(_files(path, files) for files in data.values())}; keep one format in "
            f"the folder, or give one file (--dataset {name}/{example})"
        )
    kept = set(next(iter(data.values())))
    data_files = {
        split: [str(f) for f in files if f in kept]
        for split, files in by_split.items()
        if any(f in kept for f in files)
    }
    notes = [
        f"dataset folder '{name}': skipped {_files(path, files)}: not a data format"
        for files in other.values()
    ]
    return data_files, notes


def _files(folder: Path, files: list[Path]) -> str:
    """``2 .png files (a.png, b.png)``: how many, of which types, and the first few names."""
    suffixes = "/".join(dict.fromkeys(f.suffix.lower() or "(no suffix)" for f in files))
    names = [str(f.relative_to(folder)) for f in files[:3]] + (["..."] if len(files) > 3 else [])
    plural = "s" if len(files) > 1 else ""
    return f"{len(files)} {suffixes} file{plural} ({', '.join(names)})"


def load_splits(
    config: TrainConfig,
    demo: Callable[[], tuple[Any, str]] | None = None,
    formats: dict[str, str] = LOCAL_FORMATS,
) -> tuple[dict[str, datasets.Dataset], str, list[str]]:
    """The raw splits by name, a short description of where they came from, and notes for the
    user (the files of a folder skipped as not data).

    ``demo`` builds the splits of ``--dataset demo`` (the classification demo by default);
    ``formats`` are the local file types accepted (suffix -> datasets builder).
    """
    import datasets

    if config.train_file is not None:
        train = load_local_file(config.train_file, "train", formats)
        return {"train": train}, config.train_file, []
    name = config.dataset
    if name == "demo":
        if demo is not None:
            splits, description = demo()
            return dict(splits), description, []
        from effitrain.demo import build_demo_dataset

        return dict(build_demo_dataset()), "built-in demo (MRPC-shaped sentence pairs)", []
    path = Path(name).expanduser()
    if path.is_file():
        return {"train": load_local_file(name, "train", formats)}, name, []
    if path.is_dir():
        splits, notes = load_folder(name, config, formats)
        return splits, name, notes
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
    return dict(loaded), source, []


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
