"""`effitrain estimate` beside `accelerate estimate-memory`'s answer and the measured truth.

For the distilbert-base preset's shape (65.8M parameters) at several batch x length settings and
optimizers: accelerate's "Training using Adam" figure (its own functions, on the same empty
model: accelerate's command itself needs the Hub), effitrain's estimate (fake tensors, no
weights), and what `effitrain train --max-steps 2` measures (peak tensor memory of one optimizer
step, on texts long enough that every batch is full). Prints a markdown table.

    python scripts/estimate_check.py
    python scripts/estimate_check.py --settings 8x128 --optims adamw adafactor
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def accelerate_answer(model_name: str) -> int:
    """accelerate estimate-memory's "Training using Adam" for float32, on the same model."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    from effitrain.models import load_model, load_tokenizer

    with init_empty_weights():
        model = load_model(model_name, ["0", "1"], load_tokenizer(model_name))
    total, _largest = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, "float32").values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument("--settings", nargs="+", default=["1x128", "8x128", "32x128", "8x64"])
    parser.add_argument("--optims", nargs="+", default=["adamw"])
    parser.add_argument("--json", type=Path, help="append one JSON line per row here")
    args = parser.parse_args()

    from levers import write_data

    from effitrain.build import checked_config
    from effitrain.memory.estimate import estimate

    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    adam = accelerate_answer(args.model)
    lines = [
        "| optimizer | batch x tokens | accelerate estimate-memory | effitrain estimate "
        "| measured (effitrain train) | estimate error | accelerate error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        train, validation = write_data(tmp / "data", rows=64)
        for optim in args.optims:
            for setting in args.settings:
                batch, length = (int(x) for x in setting.split("x"))
                options = {
                    "model": args.model,
                    "train_file": str(train),
                    "validation_file": str(validation),
                    "batch_size": batch,
                    "max_length": length,
                    "optim": optim,
                }
                estimated = estimate(checked_config(None, options))["peak_tensor_bytes"]
                out = tmp / "metrics.json"
                command = [
                    sys.executable,
                    "-m",
                    "effitrain",
                    "train",
                    "--quiet",
                    "--max-steps",
                    "2",
                ]
                for key, value in options.items():
                    command += [f"--{key.replace('_', '-')}", str(value)]
                command += ["--metrics-json", str(out)]
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
                subprocess.run(command, check=True, capture_output=True, env=env, cwd=ROOT)
                measured = json.loads(out.read_text())["peak_tensor_bytes"]
                row = {
                    "optimizer": optim,
                    "batch_size": batch,
                    "max_length": length,
                    "accelerate_bytes": adam if optim == "adamw" else None,
                    "estimate_bytes": estimated,
                    "measured_bytes": measured,
                }
                if args.json:
                    with args.json.open("a") as handle:
                        handle.write(json.dumps(row) + "\n")
                acc = (
                    f"{mib(adam)} | {(adam - measured) / measured:+.1%}"
                    if optim == "adamw"
                    else "– (Adam only) | –"
                )
                acc_cell, acc_error = acc.split(" | ")
                lines.append(
                    f"| {optim} | {batch} x {length} | {acc_cell} | {mib(estimated)} "
                    f"| {mib(measured)} | {(estimated - measured) / measured:+.1%} "
                    f"| {acc_error} |"
                )
                print(lines[-1], file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
