"""What each memory lever removes, measured, and what it costs in time.

The distilbert-base preset's shape (65.8M parameters, random init), batch 8 x 128 tokens, on
synthetic texts long enough to fill 128 tokens. Rows: fp32 AdamW with no levers (the baseline),
each lever alone, then all levers together with adafactor-hf (torch's adafactor cannot train
LoRA's zero-initialised adapters and is refused with LoRA). Every run is a fresh ``effitrain
train`` process (effitrain.comparison); with --repeats N the rows run in turn, N times. Per row:
each memory part of one optimizer step (parameters, gradients at their peak, optimizer state,
activations at their peak, peak tensor memory), the process's peak RSS (median), median seconds
per step (first step excluded; median over repeats), each as a ratio to the baseline.

    python -m benchmarks.levers.run --repeats 2
    python -m benchmarks.levers.run --rows baseline gradient-checkpointing --steps 3 \\
        --results .bench/levers/results.json
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common

TOPIC = common.Topic.of(__file__)
ROWS = {
    "baseline (fp32 AdamW)": [],
    "`--gradient-checkpointing`": ["--gradient-checkpointing"],
    "`--optimizer-in-backward`": ["--optimizer-in-backward"],
    "`--weights-dtype bf16`": ["--weights-dtype", "bf16"],
    "`--lora-rank 8`": ["--lora-rank", "8"],
    "all four, `--optim adafactor-hf`": [
        "--optim", "adafactor-hf", "--gradient-checkpointing", "--optimizer-in-backward",
        "--weights-dtype", "bf16", "--lora-rank", "8",
    ],
}  # fmt: skip
"""Row -> ``effitrain train`` options on top of the common ones (fp32 AdamW otherwise)."""
ROW_NAMES = {"baseline": 0, "gradient-checkpointing": 1, "optimizer-in-backward": 2}
ROW_NAMES |= {"bf16-weights": 3, "lora": 4, "all": 5}
"""Short names for --rows."""
GPU_ARGS = ["--steps", "4"]
"""The GPU variant (benchmarks/gpu.py): one run per row."""
SMOKE_ARGS = ["--rows", "baseline", "lora", "--steps", "2", "--model", "tiny"]
"""A trial on any machine, in a minute or two: the plumbing, not the numbers."""
PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("peak tensors", "peak_tensor_bytes"),
    ("peak RSS", "peak_rss_bytes"),
)


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration

    names = [list(ROWS)[ROW_NAMES[name]] for name in args.rows]
    env = common.device_env(device)
    rows = [Configuration(label=name, args=ROWS[name], env=env) for name in names]
    train, validation = common.write_long_texts(
        args.work_dir / "data", rows=args.batch_size * args.steps
    )
    shared = [
        "--model", args.model, "--train-file", str(train), "--validation-file", str(validation),
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        "--max-steps", str(args.steps), "--log-every", "1",
    ]  # fmt: skip
    comparison = common.run_configurations(
        rows, shared, args.work_dir, args.repeats, summarize=summarize
    )
    settings = {"model": args.model, "batch_size": args.batch_size}
    settings |= {"max_length": args.max_length, "steps": args.steps, "repeats": args.repeats}
    title = f"{args.model}, batch {args.batch_size} × {args.max_length} tokens"
    return common.new_run(args, device, title, settings, comparison)


def summarize(configuration, runs: list[dict]) -> common.Row:
    """Bytes from the first run (they repeat exactly); time and peak RSS the median."""
    first = runs[0]
    return {
        "row": configuration.label,
        "levers": first["levers"],
        "optimizer": first["optimizer"],
        "parameter_bytes": first["parameter_bytes"],
        "gradient_bytes": first["gradient_bytes"],
        "optimizer_state_bytes": first["optimizer_state"]["bytes"],
        "activation_bytes": first["activation_bytes"],
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "peak_memory_kind": first["peak_memory_kind"],
        "peak_rss_bytes": common.process_peak(runs),
        "seconds_per_step": common.median(runs, "seconds_per_step"),
        "eval_accuracy": first["eval"]["accuracy"],
        "repeats": len(runs),
    }


def render(run: common.Run) -> str:
    rows = run["rows"]
    base = rows[0]
    present = [(label, key) for label, key in PARTS if any(key in row for row in rows)]
    columns = [common.Column("row", lambda row: row["row"], right=False)]
    columns += [
        common.Column(label, lambda row, key=key: common.with_ratio(row, base, key, common.mib))
        for label, key in present
    ]
    columns.append(common.seconds_column(base))
    return common.markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    common.add_rows_argument(parser, ROW_NAMES)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
