"""The offload levers on a GPU: CUDA peak memory (allocated and reserved) with and without each,
beside what ``effitrain estimate`` predicts, and the time each costs.

The qwen2.5-0.5b preset (Qwen2.5-0.5B's shape, random init), batch 1 x 2048 tokens of the
causal-LM demo corpus, fp32 AdamW, no clipping in any row (the optimizer offload cannot clip).
Rows: no offload, ``--activation-offload``, ``--gradient-checkpointing`` without and with it,
``--optimizer-offload state`` and ``state+grads``, then all together. Every run is a fresh
``effitrain train`` process (effitrain.comparison); its estimate is made in this process on fake
tensors. Per row: the run's CUDA peak (``max_memory_allocated``, whole run), the measured step's
peak reserved by the caching allocator, its peak tensor memory beside the estimate's and the
error, the host bytes each offload used (measured; estimated), median seconds per step.

The offloads are CUDA levers: on a CPU device only the baseline trains (``--smoke``); the
estimates of every row are made on any machine.

    python -m benchmarks.offload.run                      # on a GPU
    python -m benchmarks.offload.run --rows baseline --model tiny-llama --max-length 64 \\
        --steps 2 --device cpu --results .bench/offload/results.json
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common

TOPIC = common.Topic.of(__file__)
GPU_ONLY = True
"""Its levers train only on CUDA: no CPU run is recorded (benchmarks/test_common.py)."""
ROWS = {
    "baseline": [],
    "activation-offload": ["--activation-offload"],
    "checkpointing": ["--gradient-checkpointing"],
    "checkpointing+activation-offload": ["--gradient-checkpointing", "--activation-offload"],
    "optimizer-offload state": ["--optimizer-offload", "state"],
    "optimizer-offload state+grads": ["--optimizer-offload", "state+grads"],
    "all": [
        "--gradient-checkpointing", "--activation-offload", "--optimizer-offload", "state+grads",
    ],
}  # fmt: skip
"""Row -> ``effitrain train`` options on top of the common ones."""
ROW_NAMES = {name.replace(" ", "-"): name for name in ROWS}
GPU_ARGS = ["--steps", "4"]
"""The GPU variant (benchmarks/gpu.py)."""
SMOKE_ARGS = ["--rows", "baseline", "--steps", "2", "--model", "tiny-llama", "--max-length", "64"]
"""A trial on any machine: the plumbing, not the numbers."""


def estimate_row(args: argparse.Namespace, options: list[str]) -> dict:
    """``effitrain estimate --device cuda`` of one row, with the run's options (its metrics
    JSON fields): the offloads are CUDA levers, so the launch estimated is one CUDA process,
    whatever this machine has."""
    from effitrain.build import checked_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate

    overrides = {
        "task": "causal-lm", "model": args.model, "batch_size": 1,
        "max_length": args.max_length, "max_grad_norm": 0.0,
        "gradient_checkpointing": "--gradient-checkpointing" in options,
        "activation_offload": "--activation-offload" in options,
    }  # fmt: skip
    if "--optimizer-offload" in options:
        overrides["optimizer_offload"] = options[options.index("--optimizer-offload") + 1]
    launch = Launch.described(1, "ddp", "cuda")
    return estimate(checked_config(None, overrides), launch).to_dict()


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration

    names = [ROW_NAMES[name] for name in args.rows]
    env = common.device_env(device)
    rows = [Configuration(label=name, args=ROWS[name], env=env) for name in names]
    shared = [
        "--task", "causal-lm", "--model", args.model, "--batch-size", "1",
        "--max-length", str(args.max_length), "--max-steps", str(args.steps),
        "--max-grad-norm", "0", "--log-every", "1",
    ]  # fmt: skip
    comparison = common.run_configurations(rows, shared, args.work_dir, summarize=summarize)
    for row in comparison.rows:
        predicted = estimate_row(args, ROWS[row["row"]])
        row["estimate_peak_tensor_bytes"] = predicted["peak_tensor_bytes"]
        row["estimate_activation_host_bytes"] = predicted.get("activation_offload_host_bytes")
        row["estimate_optimizer_host_bytes"] = _host(predicted.get("optimizer_offload"))
    settings = {"model": args.model, "batch_size": 1, "max_length": args.max_length}
    settings["steps"] = args.steps
    title = f"{args.model}, batch 1 × {args.max_length} tokens"
    return common.new_run(args, device, title, settings, comparison)


def _host(where: dict | None) -> int | None:
    """The optimizer offload's host bytes: state and the parameter and gradient copies."""
    return where["host_state_bytes"] + where["host_copy_bytes"] if where else None


def summarize(configuration, runs: list[dict]) -> common.Row:
    first = runs[0]
    step = first.get("step_memory") or {}
    return {
        "row": configuration.label,
        "levers": first["levers"],
        "peak_memory_bytes": first["peak_memory_bytes"],
        "peak_memory_kind": first["peak_memory_kind"],
        "cuda_max_reserved": step.get("cuda_max_reserved"),
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "activation_host_bytes": first.get("activation_offload_host_bytes"),
        "optimizer_host_bytes": _host(first.get("optimizer_offload")),
        "seconds_per_step": common.median(runs, "seconds_per_step"),
    }


def _pair(row: common.Row, measured: str, predicted: str) -> str:
    """``measured (estimate)`` in MiB; — where neither is there."""
    if row.get(measured) is None and row.get(predicted) is None:
        return "—"
    return (
        f"{common.shown(row.get(measured), common.mib)} "
        f"({common.shown(row.get(predicted), common.mib)})"
    )


def render(run: common.Run) -> str:
    rows = run["rows"]
    base = rows[0]
    columns = [
        common.Column("row", lambda row: row["row"], right=False),
        common.Column(
            "peak (run)", lambda row: common.with_ratio(row, base, "peak_memory_bytes", common.mib)
        ),
        common.Column(
            "reserved (step)", lambda row: common.shown(row.get("cuda_max_reserved"), common.mib)
        ),
        common.Column(
            "peak tensors (step)",
            lambda row: common.with_ratio(row, base, "peak_tensor_bytes", common.mib),
        ),
        common.Column(
            "estimate", lambda row: common.shown(row.get("estimate_peak_tensor_bytes"), common.mib)
        ),
        common.Column("error", common.estimate_error),
        common.Column(
            "host: activations (est.)",
            lambda row: _pair(row, "activation_host_bytes", "estimate_activation_host_bytes"),
        ),
        common.Column(
            "host: optimizer (est.)",
            lambda row: _pair(row, "optimizer_host_bytes", "estimate_optimizer_host_bytes"),
        ),
        common.seconds_column(base),
    ]
    return common.markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    common.add_rows_argument(parser, ROW_NAMES)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
