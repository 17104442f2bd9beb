"""``effitrain estimate`` beside ``accelerate estimate-memory``'s answer and the measured truth.

For the distilbert-base preset's shape (65.8M parameters) at several batch x length settings and
optimizers: accelerate's "Training using Adam" figure (its own functions, on the same empty
model: accelerate's command itself needs the Hub), effitrain's estimate (fake tensors, no
weights), and what ``effitrain train --max-steps 2`` measures (peak tensor memory of one
optimizer step; CUDA's max_memory_allocated over it on a GPU), on texts long enough that every
batch is full. Each measured run is a fresh process through effitrain.comparison.

    python -m benchmarks.estimate.run
    python -m benchmarks.estimate.run --settings 8x128 32x128 --optims adamw adafactor adamw-8bit
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common

TOPIC = common.Topic.of(__file__)
GPU_ARGS = ["--settings", "8x128", "32x128", "--optims", "adamw", "adafactor", "adamw-8bit"]
SMOKE_ARGS = ["--model", "tiny", "--settings", "4x32", "--optims", "adamw"]


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


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.build import checked_config
    from effitrain.comparison import Configuration
    from effitrain.estimation import estimate

    adam = accelerate_answer(args.model)
    train, validation = common.write_long_texts(args.work_dir / "data", rows=64)
    env = common.device_env(device)
    configurations = [Configuration(label=o, args=["--optim", o], env=env) for o in args.optims]
    rows = []
    for setting in args.settings:
        batch, length = (int(x) for x in setting.split("x"))
        options = {"model": args.model, "train_file": str(train),
                   "validation_file": str(validation), "batch_size": batch, "max_length": length}  # fmt: skip
        shared = [
            "--model", args.model, "--train-file", str(train), "--validation-file", str(validation),
            "--batch-size", str(batch), "--max-length", str(length), "--max-steps", "2",
        ]  # fmt: skip
        comparison = common.run_configurations(
            configurations, shared, args.work_dir / setting,
            summarize=lambda c, runs: {"optimizer": c.label, "metrics": runs[0]},
        )  # fmt: skip
        for measured in comparison.rows:
            optim = measured["optimizer"]
            estimated = estimate(checked_config(None, {**options, "optim": optim}))
            metrics = measured["metrics"]
            rows.append({
                "optimizer": optim, "batch_size": batch, "max_length": length,
                "accelerate_bytes": adam if optim == "adamw" else None,
                "estimate_bytes": estimated.memory.peak_tensor_bytes,
                "measured_bytes": metrics["peak_tensor_bytes"],
                "measured_kind": metrics["peak_memory_kind"],
            })  # fmt: skip
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": f"{args.model}, fp32, {common.where(device)}",
        "settings": {"model": args.model, "settings": args.settings, "optims": args.optims},
        "rows": rows,
    }


def error(value, truth) -> str:
    if isinstance(value, str) or isinstance(truth, str) or value is None or not truth:
        return "–"
    return f"{(value - truth) / truth:+.1%}"


def render(run: common.Run) -> str:
    def published_or(key: str, compute):
        return lambda row: row[key] if isinstance(row.get(key), str) else compute(row)

    columns = [
        common.Column("optimizer", lambda r: r["optimizer"], right=False),
        common.Column("batch × tokens", lambda r: f"{r['batch_size']} × {r['max_length']}", right=False),
        common.Column("accelerate estimate-memory", lambda r: common.shown(r.get("accelerate_bytes"), common.mib)),
        common.Column("effitrain estimate", lambda r: common.shown(r["estimate_bytes"], common.mib)),
        common.Column("measured", lambda r: common.shown(r["measured_bytes"], common.mib)),
        common.Column("estimate's error", published_or("estimate_error", lambda r: error(r["estimate_bytes"], r["measured_bytes"]))),
        common.Column("accelerate's error", published_or("accelerate_error", lambda r: error(r.get("accelerate_bytes"), r["measured_bytes"]))),
    ]  # fmt: skip
    return common.markdown_table(columns, run["rows"], drop_empty=True)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument(
        "--settings", nargs="+", default=["1x128", "8x128", "32x128", "8x64"], metavar="BxL",
        help="batch size x max length",
    )  # fmt: skip
    parser.add_argument("--optims", nargs="+", default=["adamw"])
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
