"""effitrain's loop against a minimal plain Accelerate loop (plain_loop.py): time and memory.

Both train the same model on the same data with the same batch size, optimizer, lr and schedule,
each run in a fresh process through effitrain.comparison, the two in turn (A B, B A, ...) so machine
noise hits both alike. Reported: the median over runs of each run's median time per optimizer
step (first step excluded), the median of each process's peak RSS as the kernel counted it, and
the ratios effitrain / plain. Targets: time ratio <= 1.03, peak-memory ratio <= 1.05.

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.loop_overhead.run --repeats 5 --epochs 1 \\
        --batch-size 16
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common

TOPIC = common.Topic.of(__file__)
TARGETS = {"time_ratio": 1.03, "memory_ratio": 1.05}
GPU_ARGS = ["--repeats", "2", "--epochs", "1"]
SMOKE_ARGS = ["--repeats", "1", "--max-steps", "2"]


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration
    from effitrain.optim import get_spec

    lr = args.lr if args.lr is not None else get_spec(args.optim).scratch.lr
    shared = [
        "--optim", args.optim, "--lr", repr(lr), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
    ]  # fmt: skip
    if args.max_steps:
        shared += ["--max-steps", str(args.max_steps)]
    env = common.device_env(device)
    plain = [sys.executable, "-m", "benchmarks.loop_overhead.plain_loop"]
    rows = [
        Configuration(label="effitrain", env=env),
        Configuration(label="plain", env=env, program=plain),
    ]
    comparison = common.run_configurations(
        rows, shared, args.work_dir, args.repeats, summarize=summarize, alternate=True
    )
    if comparison.failed:
        raise SystemExit(f"error: a loop failed: {comparison.failed}")
    effitrain, plain_row = comparison.rows
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": f"{args.optim}, batch {args.batch_size}, {args.repeats} runs each, "
        + common.where(device),
        "settings": {
            "optim": args.optim,
            "lr": lr,
            "epochs": args.epochs,
            "max_steps": args.max_steps,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "repeats": args.repeats,
        },  # fmt: skip
        "rows": [plain_row, effitrain],
        "summary": {
            "time_ratio": effitrain["ms_per_step"] / plain_row["ms_per_step"],
            "memory_ratio": effitrain["peak_rss_bytes"] / plain_row["peak_rss_bytes"],
        },
    }


def summarize(configuration, runs: list[dict]) -> common.Row:
    return {
        "loop": configuration.label,
        "ms_per_step": 1000 * common.median(runs, "seconds_per_step"),
        "peak_rss_bytes": common.process_peak(runs),
        "accuracy": common.median([run["eval"] for run in runs], "accuracy"),
        "ms_per_step_runs": [1000 * run["seconds_per_step"] for run in runs],
        "peak_rss_bytes_runs": [run["process"]["peak_rss_bytes"] for run in runs],
    }


def render(run: common.Run) -> str:
    summary = run["summary"]
    ratio_row = {
        "loop": "ratio effitrain / plain",
        "ms_per_step": f"{summary['time_ratio']:.3f} (target ≤ {TARGETS['time_ratio']})",
        "peak_rss_bytes": f"{summary['memory_ratio']:.3f} (target ≤ {TARGETS['memory_ratio']})",
    }
    columns = [
        common.Column("loop", lambda row: row["loop"], right=False),
        common.Column(
            "median ms/step", lambda row: common.shown(row["ms_per_step"], lambda v: f"{v:.2f}")
        ),
        common.Column(
            "median peak RSS", lambda row: common.shown(row["peak_rss_bytes"], common.mib)
        ),
    ]
    return common.markdown_table(columns, [*run["rows"], ratio_row])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optim", default="adamw", choices=["adamw", "adafactor", "adamw-8bit"])
    parser.add_argument("--lr", type=float, help="default: effitrain's from-scratch lr for --optim")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, help="stop both loops after this many steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
