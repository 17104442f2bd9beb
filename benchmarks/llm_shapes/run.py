"""What fine-tuning a real LLM takes at 1 x 2048 tokens, per memory lever: ``effitrain estimate``
on the model's config.json alone (no weights, no tokenizer, no hub).

Three published shapes (Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-7B: the values of their config.json,
written here as dicts and saved by this script) times five configurations, each the
``effitrain estimate`` command line a user would type for a CUDA card (``--device cuda``, where
the offload levers run), in a fresh process (its ``--json``).
A configuration the current code refuses is recorded as refused, with its one-line error: never
estimated some other way. Per row: peak tensor memory of one optimizer step, its parts, whether
that peak fits a 24, 48 or 80 GB card, and how long the estimate took.

    python -m benchmarks.llm_shapes.run
    python -m benchmarks.llm_shapes.run --models llama-3.2-1b --configurations plain lora \\
        --results .bench/llm_shapes/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
LLAMA_3 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
MODELS = {
    "Llama-3.2-1B": {
        **LLAMA_3, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "transformers_version": "4.45.0.dev0",
    },
    "Llama-3.1-8B": {
        **LLAMA_3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "transformers_version": "4.43.0.dev0",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 152064,
    },
}  # fmt: skip
"""The published config.json of each model (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B,
Qwen/Qwen2.5-7B on the Hugging Face hub)."""
LEAN = ["--weights-dtype", "bf16", "--optimizer-in-backward", "--gradient-checkpointing"]
LEAN += ["--chunked-loss", "auto"]
LORA = ["--lora-rank", "16", "--weights-dtype", "bf16", "--gradient-checkpointing"]
CONFIGURATIONS = {
    "plain": ("AdamW, fp32 weights", []),
    "lean": (
        "bf16 weights + Adafactor + step in backward + checkpointing + chunked loss",
        ["--optim", "adafactor", *LEAN],
    ),
    "lean-8bit": ("the same with 8-bit AdamW state", ["--optim", "adamw-8bit", *LEAN]),
    "lean-offload": (
        "bf16 weights + Adafactor + checkpointing + chunked loss, the step and the gradients "
        "on the host (CUDA: torchao's CPUOffloadOptimizer)",
        [
            "--optim",
            "adafactor",
            "--weights-dtype",
            "bf16",
            "--gradient-checkpointing",
            "--chunked-loss",
            "auto",
            "--optimizer-offload",
            "state+grads",
        ],
    ),
    "lora": ("LoRA r=16 (AdamW) on a bf16 base, checkpointing", LORA),
    "qlora": (
        "QLoRA: LoRA r=16 on a 4-bit NF4 base (the rest fp32), checkpointing",
        ["--lora-rank", "16", "--load-in-4bit", "--gradient-checkpointing"],
    ),
    "qlora-bf16": (
        "QLoRA as torchtune's recipe: LoRA r=16 without dropout on a 4-bit NF4 base, the rest "
        "bf16, checkpointing",
        [
            *("--lora-rank", "16", "--lora-dropout", "0", "--load-in-4bit"),
            *("--weights-dtype", "bf16", "--gradient-checkpointing"),
        ],
    ),
}
"""Short name -> (what it is, ``effitrain estimate`` options besides model, batch and length)."""
FULL = ("plain", "lean", "lean-8bit", "lean-offload")
"""The configurations that train every weight."""
CARDS_GB = (24, 48, 80)
"""Cards' memory as sold: a "24 GB" card holds 24 GiB (24,564 MiB on an RTX 4090)."""
GOAL = ("Llama-3.1-8B", 20 * 2**30)
"""Issue 29's goal: full-parameter fine-tuning of this model at 1 x 2048 within this peak."""
QLORA_GOAL = ("Llama-3.1-8B", "qlora-bf16", int(7.4 * 2**30))
"""Issue 37's goal: this QLoRA configuration at 1 x 2048 within torchtune's measured peak."""
PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
)


def write_config(folder: Path, name: str) -> Path:
    """``folder/<name>/config.json`` holding the published config, nothing else."""
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=1) + "\n")
    return path


def estimate_row(model_dir: Path, options: list[str], batch: int, length: int) -> common.Row:
    """One ``effitrain estimate --json`` in a fresh process: its numbers, or its refusal."""
    command = [
        sys.executable, "-m", "effitrain", "estimate", "--task", "causal-lm",
        "--model", str(model_dir), "--batch-size", str(batch), "--max-length", str(length),
        "--device", "cuda", *options, "--json",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=common.REPO)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        if errors:
            return {"refused": errors[0].removeprefix("error:").strip()}
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit {proc.returncode}: {tail}"}
    result = json.loads(proc.stdout)
    return {
        "parameter_bytes": result["parameter_bytes"],
        "trainable_parameters": result["trainable_parameters"],
        "gradient_bytes": result["gradient_bytes"],
        "optimizer_state_bytes": result["optimizer_state"]["bytes"],
        "activation_bytes": result["activation_bytes"],
        "peak_tensor_bytes": result["peak_tensor_bytes"],
        "host_peak_bytes": result.get("host_peak_bytes"),
        "activation_offload_host_bytes": result.get("activation_offload_host_bytes"),
        "levers": result["levers"],
        "notes": result["notes"],
        "seconds": round(seconds, 1),
    }


def measure(args: argparse.Namespace, device: str) -> common.Run:
    batch, length = (int(x) for x in args.setting.split("x"))
    names = {name.lower(): name for name in MODELS}
    rows = []
    for model in (names[m.lower()] for m in args.models):
        folder = write_config(args.work_dir / "models", model)
        for key in args.configurations:
            print(f"{model}: {key}", file=sys.stderr, flush=True)
            row = estimate_row(folder, CONFIGURATIONS[key][1], batch, length)
            rows.append({"model": model, "configuration": key, **row})
    failed = [row for row in rows if "failed" in row]
    return {
        "name": args.name or "estimate",
        "title": f"{batch} × {length} tokens, effitrain estimate on config.json alone",
        "settings": {
            "batch_size": batch,
            "max_length": length,
            "configurations": {key: CONFIGURATIONS[key] for key in args.configurations},
        },
        "rows": rows,
        "notes": [f"{r['model']}, {r['configuration']}: failed: {r['failed']}" for r in failed],
        "failed": bool(failed),
    }


def fits(row: common.Row, gb: int) -> str:
    """yes, tight (the peak is within the card's last 10 %: the CUDA context, allocator caching
    and workspaces are not in it) or no."""
    peak = row.get("peak_tensor_bytes")
    if not isinstance(peak, int):
        return "–"
    capacity = gb * 2**30
    return "yes" if peak <= 0.9 * capacity else "tight" if peak <= capacity else "no"


def outcome(row: common.Row) -> str:
    if "refused" in row:
        return "refused"
    if "failed" in row:
        return "failed"
    return common.size(row["peak_tensor_bytes"])


def goal_line(run: common.Run) -> str:
    """Whether the issue's goal is met by any full-parameter row of its model."""
    model, limit = GOAL
    full = [r for r in run["rows"] if r["model"] == model and r["configuration"] in FULL]
    rows = [r for r in full if "peak_tensor_bytes" in r]
    missing = [f"`{r['configuration']}`" for r in full if "peak_tensor_bytes" not in r]
    goal = f"**Goal:** {model} full-parameter fine-tuning at ≤ {common.size(limit)} peak"
    unknown = f" ({', '.join(missing)}: not estimated, see below)" if missing else ""
    if not rows:
        return f"{goal}: no full-parameter configuration of it was estimated{unknown}."
    best = min(rows, key=lambda r: r["peak_tensor_bytes"])
    verdict = "met" if best["peak_tensor_bytes"] <= limit else "not met"
    return (
        f"{goal}: {verdict}; the lowest estimated is {common.size(best['peak_tensor_bytes'])} "
        f"(`{best['configuration']}`){unknown}."
    )


def qlora_goal_line(run: common.Run) -> str:
    """Whether the QLoRA row of the issue's goal is within torchtune's figure."""
    model, key, limit = QLORA_GOAL
    rows = [r for r in run["rows"] if (r["model"], r["configuration"]) == (model, key)]
    goal = f"**Goal:** {model} `{key}` at ≤ {common.size(limit)} peak (torchtune's measured figure)"
    if not rows or "peak_tensor_bytes" not in rows[0]:
        return f"{goal}: not estimated."
    peak = rows[0]["peak_tensor_bytes"]
    return f"{goal}: {'met' if peak <= limit else 'not met'}, {common.size(peak)}."


def render(run: common.Run) -> str:
    configurations = run["settings"]["configurations"]
    legend = common.markdown_table(
        [
            common.Column("configuration", lambda c: f"`{c['key']}`", right=False),
            common.Column("what", lambda c: c["what"], right=False),
            common.Column("options", lambda c: f"`{' '.join(c['options']) or '–'}`", right=False),
        ],
        [{"key": k, "what": what, "options": options} for k, (what, options) in configurations.items()],
    )  # fmt: skip
    columns = [
        common.Column("model", lambda r: r["model"], right=False),
        common.Column("configuration", lambda r: f"`{r['configuration']}`", right=False),
        common.Column("peak tensor memory", outcome),
        *(common.Column(label, lambda r, k=key: common.shown(r.get(k), common.size)) for label, key in PARTS),
        *(common.Column(f"fits {gb} GB", lambda r, gb=gb: fits(r, gb)) for gb in CARDS_GB),
        common.Column("estimate took", lambda r: common.shown(r.get("seconds"), "{:.0f} s".format)),
    ]  # fmt: skip
    table = common.markdown_table(columns, run["rows"])
    refusals: dict[str, str] = {}
    for row in run["rows"]:
        if "refused" in row:
            refusals.setdefault(row["configuration"], row["refused"])
    lines = [f"- `{key}` refused: {why}" for key, why in refusals.items()]
    goals = [goal_line(run), qlora_goal_line(run)]
    return "\n\n".join([legend, table, *goals, *(["\n".join(lines)] if lines else [])])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument(
        "--models", nargs="+", default=[name.lower() for name in MODELS], metavar="NAME",
        help=f"which shapes (default: all of {', '.join(MODELS)}; any case)",
    )  # fmt: skip
    parser.add_argument(
        "--configurations", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS),
        metavar="NAME", help=f"which configurations (default: all of {', '.join(CONFIGURATIONS)})",
    )  # fmt: skip
    parser.add_argument("--setting", default="1x2048", metavar="BxL", help="batch x tokens")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m.lower() not in {n.lower() for n in MODELS}]
    if unknown:
        parser.error(f"unknown model {unknown[0]}; choose from {', '.join(MODELS)}")
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
