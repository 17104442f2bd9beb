"""Long sequences: a packed block costs what an unpacked row of its length costs (over
document_attention.MASKED_UP_TO tokens its documents are attended one by one, no mask), and the estimate follows the run at every length, packed or not
(benchmarks/long_context runs the same comparison up to 32k tokens)."""

from __future__ import annotations

import json
import random

import pytest


def peaks(train_cli, tmp_path, args: list[str]) -> tuple[int, int]:
    """The measured and the estimated peak tensor bytes of ``args``."""
    from effitrain.cli.compare import train_config
    from effitrain.estimation import estimate

    metrics = tmp_path / "metrics.json"
    proc = train_cli("train", "--quiet", "--max-steps", "2", *args, "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(metrics.read_text())["peak_tensor_bytes"]
    return measured, estimate(train_config(args)).memory.peak_tensor_bytes


@pytest.mark.slow
@pytest.mark.parametrize("length", [4096])  # 2,048: tests/test_estimate.py, two documents a block
def test_packed_and_unpacked_at_length(train_cli, tmp_path, long_lm_model_dir, length):
    """Packed: several documents per block (of 130 to 800 tokens). Unpacked: rows of exactly
    ``length`` tokens ("a" is one token; length - 1 of them and the eos), so every row is as
    long as the estimate assumes."""
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "over", "hills"]
    documents = tmp_path / "documents.txt"
    documents.write_text(
        "\n\n".join(" ".join(rng.choices(words, k=rng.randint(50, 300))) for _ in range(80))
    )
    rows = tmp_path / "rows.txt"
    rows.write_text("\n\n".join([" ".join(["a"] * (length - 1))] * 6) + "\n")
    common = ["--task", "causal-lm", "--model", str(long_lm_model_dir), "--batch-size", "1",
              "--max-length", str(length)]  # fmt: skip
    packed = peaks(train_cli, tmp_path, [*common, "--train-file", str(documents)])
    unpacked = peaks(
        train_cli,
        tmp_path,
        [*common, "--train-file", str(rows), "--validation-file", str(rows), "--no-packing"],
    )
    for measured, estimated in (packed, unpacked):
        assert abs(estimated - measured) <= 0.02 * measured, (estimated, measured)
    assert packed[0] <= 1.1 * unpacked[0], (packed, unpacked)
