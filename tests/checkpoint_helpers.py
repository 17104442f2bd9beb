"""Helpers shared by the checkpoint, resume and inspect-state tests: tiny data, runs, comparisons."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

TRAIN_ROWS = 24  # 6 optimizer steps per epoch at batch size 4
BATCH = 4

POSITIVE = ["great", "lovely", "fine", "superb", "pleasant"]
NEGATIVE = ["awful", "terrible", "poor", "dreadful", "boring"]


def write_data(folder: Path) -> tuple[Path, Path, Path]:
    """A 24-row training csv, an 8-row validation csv (text, label), and a tiny model folder.

    The model is the tiny preset with every dropout at 0.1 (the preset itself trains without
    dropout), so exact-resume tests prove that dropout randomness comes back too.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train.csv", TRAIN_ROWS), ("validation.csv", 8)):
        path = folder / name
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["text", "label"])
            for i in range(rows):
                words = POSITIVE if i % 2 else NEGATIVE
                writer.writerow(
                    [f"the film was {words[i % 5]} and {words[(i * 3) % 5]} number {i}", i % 2]
                )
        paths.append(path)
    return paths[0], paths[1], save_tiny_model(folder / "model", dropout=0.1)


def save_tiny_model(folder: Path, dropout: float, labels: tuple[str, ...] = ("0", "1")) -> Path:
    """The tiny preset with every dropout set to ``dropout``, saved with save_pretrained."""
    from effitrain.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    model = load_model("tiny", list(labels), tokenizer)
    for name in ("dropout", "attention_dropout", "seq_classif_dropout"):
        setattr(model.config, name, dropout)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_args(data: tuple[Path, Path, Path], out: Path, *extra: str) -> list[str]:
    """``train`` arguments for a quick run on the tiny data and model, writing to ``out``."""
    train, validation, model = data
    return [
        "train",
        "--model",
        str(model),
        "--train-file",
        str(train),
        "--validation-file",
        str(validation),
        "--batch-size",
        str(BATCH),
        "--log-every",
        "1",
        "--output-dir",
        str(out),
        *extra,
    ]


def load_tensors(folder: Path) -> dict[str, Any]:
    """Model weights, optimizer and scheduler state of a checkpoint (or a final/ folder)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {"model": load_file(folder / "model.safetensors")}
    for name in ("optimizer.bin", "scheduler.bin"):
        if (folder / name).exists():
            out[name] = torch.load(folder / name, weights_only=True, map_location="cpu")
    return out


def assert_identical(a: Any, b: Any, where: str = "") -> int:
    """Recursively compare nested state: tensors with torch.equal (bit-identical), the rest with ==.

    Returns the number of tensors compared.
    """
    import torch

    if isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter):
        # A tensor subclass (torchao's quantized optimizer state): its inner tensors.
        names, context = a.__tensor_flatten__()
        assert type(b) is type(a) and b.__tensor_flatten__() == (names, context), where
        return sum(assert_identical(getattr(a, n), getattr(b, n), f"{where}.{n}") for n in names)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"tensors differ at {where}"
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {where}"
        return sum(assert_identical(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        return sum(
            assert_identical(x, y, f"{where}[{i}]")
            for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    assert a == b, f"{where}: {a!r} != {b!r}"
    return 0


def resume_copy(
    train_cli: Any, out: Path, options: Any, folder: Path, *extra: str, step: int = 2
) -> Any:
    """``effitrain train`` with ``options`` resumed in a new ``folder`` from a copy of
    ``out/checkpoint-<step>`` (``out`` itself left as it is)."""
    folder.mkdir()
    shutil.copytree(out / f"checkpoint-{step}", folder / f"checkpoint-{step}")
    return train_cli("train", *options, "--output-dir", str(folder), "--resume", "latest", *extra)
