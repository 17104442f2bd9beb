"""The LLM-scale levers on a real LLM shape: what each removes, measured beside its estimate, and
what it costs in time.

The qwen2.5-0.5b preset (Qwen2.5-0.5B's exact architecture: 494M parameters, a 151,936-token
vocabulary; random init) at 1 x 2048 tokens, causal-LM training on packed synthetic text. Rows:
fp32 AdamW with the full logits (the plain run), each new lever that runs on this device alone,
then all of them together, once for full fine-tuning and once for QLoRA. Every run is a fresh
``effitrain train`` process (effitrain.comparison); beside each, ``effitrain estimate`` of the same
options (in this process, fake tensors). Per row: each memory part of one optimizer step, the
process's peak RSS, seconds per step (the first excluded), and the estimate's error on the peak.

    python -m benchmarks.llm_levers.run
    python -m benchmarks.llm_levers.run --rows plain chunked --steps 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
ROWS = {
    "plain: fp32 AdamW, full logits": ["--chunked-loss", "off"],
    "`--chunked-loss torch`": ["--chunked-loss", "torch"],
    "`--load-in-4bit --lora-rank 16`": [
        "--load-in-4bit", "--lora-rank", "16", "--chunked-loss", "off",
    ],
    "`--optim adafactor --weights-dtype bf16`": [
        "--optim", "adafactor", "--weights-dtype", "bf16", "--chunked-loss", "off",
    ],
    "all, full fine-tuning: bf16 adafactor in backward, checkpointing, chunked loss": [
        "--optim", "adafactor", "--weights-dtype", "bf16", "--optimizer-in-backward",
        "--gradient-checkpointing", "--chunked-loss", "torch",
    ],
    "all, QLoRA: 4-bit base, rank 16, checkpointing, chunked loss": [
        "--load-in-4bit", "--lora-rank", "16", "--gradient-checkpointing",
        "--chunked-loss", "torch",
    ],
}  # fmt: skip
"""Row -> ``effitrain train`` options on top of the common ones (fp32 AdamW otherwise)."""
ROW_NAMES = {"plain": 0, "chunked": 1, "qlora": 2, "bf16-adafactor": 3, "all-full": 4}
ROW_NAMES |= {"all-qlora": 5}
"""Short names for --rows."""
GPU_ARGS = ["--steps", "3"]
"""The GPU variant (benchmarks/gpu.py): one run per row."""
SMOKE_ARGS = ["--rows", "plain", "chunked", "--steps", "2", "--model", "tiny-llama",
              "--max-length", "128"]  # fmt: skip
"""A trial on any machine, in a minute or two: the plumbing, not the numbers."""
PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("peak tensors", "peak_tensor_bytes"),
    ("peak RSS", "peak_rss_bytes"),
)
WORDS = ("the", "committee", "approved", "a", "new", "budget", "report", "and", "board",
         "rejected", "plan", "on", "monday", "while", "prices", "rose", "in", "city")  # fmt: skip


def write_texts(folder: Path, documents: int, length: int) -> tuple[Path, Path]:
    """train.jsonl (``documents`` texts of ``length`` words) and validation.jsonl (one text of
    ``length`` words): synthetic, deterministic, for memory and time; packed into full blocks."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n in (("train", documents), ("validation", 1)):
        path = folder / f"{name}.jsonl"
        texts = (" ".join(rng.choices(WORDS, k=length)) for _ in range(n))
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        paths.append(path)
    return paths[0], paths[1]


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.cli.compare import train_config
    from effitrain.comparison import Configuration
    from effitrain.estimation import estimate

    names = [list(ROWS)[ROW_NAMES[name]] for name in args.rows]
    env = common.device_env(device)
    rows = [Configuration(label=name, args=ROWS[name], env=env) for name in names]
    train, validation = write_texts(args.work_dir / "data", args.steps + 1, args.max_length + 64)
    shared = [
        "--task", "causal-lm", "--model", args.model, "--train-file", str(train),
        "--validation-file", str(validation), "--batch-size", "1", "--eval-batch-size", "1",
        "--max-length", str(args.max_length), "--max-steps", str(args.steps), "--log-every", "1",
    ]  # fmt: skip
    if device != "cpu":
        shared += ["--mixed-precision", "bf16"]
    comparison = common.run_configurations(
        rows, shared, args.work_dir, args.repeats, summarize=summarize
    )
    for row in comparison.rows:  # each run's own options, estimated in this process
        try:
            predicted = estimate(train_config([*shared, *ROWS[row["row"]]]))
        except Exception as exc:  # noqa: BLE001 - recorded beside the measurement
            row["estimate_error"] = f"{type(exc).__name__}: {exc}"
            continue
        row["estimate"] = {key: _part(predicted.memory, key) for _label, key in PARTS[:-1]}
    settings = {"model": args.model, "batch_size": 1, "max_length": args.max_length}
    settings |= {"steps": args.steps, "repeats": args.repeats}
    title = f"{args.model}, causal LM, batch 1 × {args.max_length} tokens"
    return common.new_run(args, device, title, settings, comparison)


def _part(memory, key: str):
    """One part of an estimate's :class:`effitrain.results.MemoryRecord`, by the metrics
    JSON's field name."""
    if key == "optimizer_state_bytes":
        return memory.optimizer_state.bytes
    return getattr(memory, key)


def summarize(configuration, runs: list[dict]) -> common.Row:
    """Bytes from the first run (they repeat exactly); time and peak RSS the median."""
    first = runs[0]
    return {
        "row": configuration.label,
        "levers": first["levers"],
        "optimizer": first["optimizer"],
        "loss": first.get("loss"),
        "parameter_bytes": first["parameter_bytes"],
        "gradient_bytes": first["gradient_bytes"],
        "optimizer_state_bytes": first["optimizer_state"]["bytes"],
        "activation_bytes": first["activation_bytes"],
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "peak_memory_kind": first["peak_memory_kind"],
        "peak_memory_bytes": first["peak_memory_bytes"],
        "peak_rss_bytes": common.process_peak(runs),
        "seconds_per_step": common.median(runs, "seconds_per_step"),
        "eval_loss": first["eval"]["loss"],
        "repeats": len(runs),
    }


def _estimated(row: dict, key: str) -> str:
    predicted = (row.get("estimate") or {}).get(key)
    measured = row.get(key)
    if predicted is None or not measured:
        return "-"
    return f"{common.mib(predicted)} ({(predicted - measured) / measured:+.1%})"


def render(run: common.Run) -> str:
    rows = run["rows"]
    base = rows[0]
    columns = [common.Column("row", lambda row: row["row"], right=False)]
    columns += [
        common.Column(label, lambda row, key=key: common.with_ratio(row, base, key, common.mib))
        for label, key in PARTS
    ]
    columns += [
        common.Column("estimated peak (error)", lambda row: _estimated(row, "peak_tensor_bytes")),
        common.Column(
            "estimated activations (error)", lambda row: _estimated(row, "activation_bytes")
        ),
        common.seconds_column(base),
    ]
    return common.markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    common.add_rows_argument(parser, ROW_NAMES)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
