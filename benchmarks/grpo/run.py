"""GRPO (issue 47): effitrain's ``--task grpo`` beside TRL 1.16's ``GRPOTrainer`` on the same
model, prompts, reward and settings: each optimizer step's mean reward, each process's peak RSS
and its median seconds per step, for several seeds.

The model is the tiny-llama preset (random init from :data:`INIT_SEED`), saved once as a folder
that both sides load; the prompts are the built-in demo's (120 for training; effitrain also
evaluates its 32 validation prompts after each epoch, outside its step times); the reward is
effitrain's built-in ``letter_share``, which TRL calls as a reward function. Every setting is
given explicitly on both sides (:data:`SETTINGS`; ``trl_side.py`` for TRL's). Each run is a
fresh process through effitrain.comparison, one at a time, effitrain and TRL alternately (seed
0: effitrain, TRL; seed 1: effitrain, TRL; ...), each with the same torch thread count.

The issue's learning goal, per seed and over the seeds: effitrain's mean reward rises (first
:data:`WINDOW` steps to the last) at least 70 % as much as TRL's, and its last steps' mean is
no more than 0.05 below TRL's.

    OMP_NUM_THREADS=1 python -m benchmarks.grpo.run                    # 3 seeds x 2 sides
    python -m benchmarks.grpo.run --seeds 0 --steps 20 --results .bench/grpo/results.json

``--what cases`` (the GPU variant, :data:`GPU_ARGS`) is effitrain alone, on a GPU: GRPO's
generation there (KV cache, sampling) and its references, each case (:data:`CASES`) a few
steps of the demo's prompts on the qwen2.5-0.5b preset (Qwen2.5-0.5B's shape, random init)
beside ``effitrain estimate`` of the same options: each phase's peak (generation, training)
measured and estimated, the run's CUDA peak, the reference's bytes, seconds per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
TRL = [sys.executable, "-m", "benchmarks.grpo.trl_side"]
"""The TRL side's program (its options are its own, not ``effitrain train``'s)."""
INIT_SEED = 42
"""The seed the model folder's random weights are drawn from (the demo's default seed)."""
WINDOW = 10
"""Steps averaged at each end of a reward curve (the first and the last)."""
CURVE_POINTS = 10
"""Windows of the rendered reward curve."""
HALFWAY = 0.5
"""A reward the curves pass on their way up (the share of e's; about 0.12 at the start)."""
RISE_SHARE, LAST_GAP = 0.70, 0.05
"""The goal: effitrain's rise at least this share of TRL's; its last mean at most this below."""
SETTINGS = {
    "num_generations": 8,
    "max_completion_length": 16,
    "batch_size": 16,
    "lr": 1e-3,
    "warmup_ratio": 0.06,
    "weight_decay": 0.01,
}
"""What both sides are given: the demo's (its batch, G, completion length, and AdamW's lr,
warmup and weight decay for a model trained from scratch, which a model folder does not get by
default: there effitrain would take the fine-tuning lr / 40)."""
CASES = {
    "bf16": ("bf16 autocast, no reference", ["--mixed-precision", "bf16"]),
    "copy-bf16": ("bf16 autocast, KL to a bf16 copy", [
        "--mixed-precision", "bf16", "--beta", "0.04", "--reference", "copy",
        "--reference-dtype", "bf16",
    ]),
    "qlora": ("QLoRA r16, no reference", [
        "--lora-rank", "16", "--load-in-4bit", "--mixed-precision", "bf16",
    ]),
    "qlora-adapters": ("QLoRA r16, KL to the base with the adapters off", [
        "--lora-rank", "16", "--load-in-4bit", "--mixed-precision", "bf16", "--beta", "0.04",
    ]),
}  # fmt: skip
"""``--what cases``: case -> (what it is, its options on top of the demo's prompts and reward)."""
GPU_ARGS = ["--what", "cases", "--steps", "3"]
"""The GPU variant (benchmarks/gpu.py): each case, 3 steps, beside its estimate."""
SMOKE_ARGS = ["--what", "cases", "--cases", "bf16", "copy-bf16", "--steps", "2", "--model",
              "tiny-llama", "--completion-length", "8"]  # fmt: skip
"""A trial on any machine: the plumbing, not the numbers."""
FIXED = ["--optim", "adamw", "--scheduler", "linear", "--max-grad-norm", "1.0", "--beta", "0",
         "--grpo-loss", "dapo", "--scale-rewards", "group", "--epsilon", "0.2",
         "--temperature", "1", "--top-p", "1", "--grad-accum", "1"]  # fmt: skip
"""effitrain's settings that ``trl_side.py`` sets alike in its ``GRPOConfig`` (TRL's defaults
there, except that none is left to a default here)."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def model_folder(cache: Path) -> Path:
    """The tiny-llama preset (random init from :data:`INIT_SEED`) and its tokenizer, saved once
    as a folder that both sides load."""
    folder = cache / f"grpo-tiny-llama-seed{INIT_SEED}"
    if not (folder / "config.json").exists():
        from accelerate.utils import set_seed

        from effitrain.models import load_causal_lm, load_tokenizer

        set_seed(INIT_SEED)
        tokenizer = load_tokenizer("tiny-llama")
        load_causal_lm("tiny-llama", tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder.resolve()


def write_prompts(folder: Path) -> tuple[Path, Path]:
    """train.jsonl and validation.jsonl: the built-in demo's prompts, as effitrain loads them."""
    from effitrain.config import TrainConfig
    from effitrain.tasks.grpo_data import load_prompt_data

    data = load_prompt_data(TrainConfig(task="grpo"))
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, split in (("train", data.train), ("validation", data.validation)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in split["prompt"]))
        paths.append(path)
    return paths[0], paths[1]


def warmup_steps(steps: int) -> int:
    """The warmup as a step count, as effitrain rounds its ratio (up), given alike to both sides."""
    return math.ceil(steps * SETTINGS["warmup_ratio"])


def side_options(args: argparse.Namespace, folder: Path, data: tuple[Path, Path], seed: int):
    """Each side's command-line options for one seed: (effitrain's, TRL's)."""
    s = SETTINGS
    shared = {
        "--model": folder, "--train-file": data[0], "--max-steps": args.steps,
        "--warmup-steps": warmup_steps(args.steps), "--seed": seed, "--lr": s["lr"],
        "--weight-decay": s["weight_decay"], "--batch-size": s["batch_size"],
        "--num-generations": s["num_generations"],
        "--max-completion-length": s["max_completion_length"],
    }  # fmt: skip
    both = [str(word) for pair in shared.items() for word in pair]
    output = args.work_dir / "output" / f"seed{seed}"
    effitrain = ["--task", "grpo", *both, "--validation-file", str(data[1]), *FIXED,
                 "--log-every", "1", "--save-strategy", "no", "--output-dir", str(output)]  # fmt: skip
    return effitrain, both


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, device: str) -> common.Run:
    return measure_cases(args, device) if args.what == "cases" else measure_trl(args, device)


def measure_trl(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.checkpoints import CACHE
    from effitrain.comparison import Configuration

    folder = model_folder(CACHE)
    data = write_prompts(args.work_dir / "data")
    shutil.rmtree(args.work_dir / "output", ignore_errors=True)  # effitrain keeps its models
    # The same thread count for both sides (the machine is shared: ratios are what compare).
    env = {**common.device_env(device), **threads_env(args.threads)}
    rows = []
    for seed in args.seeds:  # effitrain and TRL alternately, one process at a time
        effitrain, trl = side_options(args, folder, data, seed)
        program = [sys.executable, "-m", "effitrain", "train", "--quiet"]
        rows.append(Configuration(f"effitrain-seed{seed}", effitrain, env, program=program))
        rows.append(Configuration(f"trl-seed{seed}", trl, env, program=TRL))
    comparison = common.run_configurations(rows, [], args.work_dir / "runs", summarize=summarize)
    settings = {
        "model": f"tiny-llama (random init, seed {INIT_SEED})",
        "prompts": "the demo's 120 training prompts",
        "reward": "letter_share",
        "steps": args.steps,
        "warmup_steps": warmup_steps(args.steps),
        "seeds": args.seeds,
        "torch_threads": args.threads,
        **SETTINGS,
    }
    title = (
        f"tiny-llama, G {SETTINGS['num_generations']} × {SETTINGS['max_completion_length']} "
        f"tokens, batch {SETTINGS['batch_size']}, {args.steps} steps, {len(args.seeds)} "
        + ("seeds" if len(args.seeds) > 1 else "seed")
    )
    run = common.new_run(args, device, title, settings, comparison)
    run["notes"] += [f"torch threads per process: {args.threads} (OMP_NUM_THREADS, both sides)"]
    return run


def measure_cases(args: argparse.Namespace, device: str) -> common.Run:
    """Each case a fresh ``effitrain train`` process, one after another; meanwhile, beside them,
    ``effitrain estimate`` of each case's options, all at once (an estimate is the run on fake
    tensors, on the CPU: a generation through 24 layers takes minutes)."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.long_context.run import effitrain_json
    from effitrain.comparison import Configuration

    shutil.rmtree(args.work_dir / "output", ignore_errors=True)  # effitrain keeps its models
    env = common.device_env(device)
    s = SETTINGS
    shared = [
        "--task", "grpo", "--model", args.model, "--batch-size", str(s["batch_size"]),
        "--num-generations", str(s["num_generations"]), "--max-completion-length",
        str(args.completion_length), "--max-steps", str(args.steps), "--log-every", "1",
        "--save-strategy", "no",
    ]  # fmt: skip
    rows = [
        Configuration(case, [*CASES[case][1], "--output-dir", str(args.work_dir / "output" / case)], env)
        for case in args.cases
    ]  # fmt: skip
    described = ["--device", "cuda"] if device == "cuda" else []
    with ThreadPoolExecutor(len(args.cases)) as pool:
        estimates = {
            case: pool.submit(effitrain_json, "estimate", [*shared, *CASES[case][1], *described], device)
            for case in args.cases
        }  # fmt: skip
        comparison = common.run_configurations(
            rows, shared, args.work_dir / "runs", summarize=cases_row
        )
        for row in comparison.rows:
            predicted = estimates[row["row"]].result()
            row["estimate"] = {key: predicted.get(key) for key in PHASES}
            failed = predicted.get("failed") and f"the estimate failed: {predicted['failed']}"
            row["estimate"]["refused"] = predicted.get("refused") or failed
            row["estimate_seconds"] = predicted["seconds"]
    settings = {"what": "cases", "model": args.model, "steps": args.steps}
    settings |= {"completion_length": args.completion_length, **s}
    title = (
        f"{args.model}, the demo's prompts, G {s['num_generations']} × {args.completion_length} "
        f"tokens, batch {s['batch_size']}, {args.steps} steps: each phase beside its estimate"
    )
    return common.new_run(args, device, title, settings, comparison)


PHASES = ("generation_peak_bytes", "training_peak_bytes", "peak_tensor_bytes")
"""The metrics JSON's (and the estimate's) peaks of a GRPO step: each phase's, and the step's."""


def cases_row(configuration, runs: list[dict]) -> common.Row:
    m = runs[0]
    return {
        "row": configuration.label,
        **{key: m.get(key) for key in PHASES},
        "peak_phase": m.get("peak_phase"),
        "peak_memory_bytes": m["peak_memory_bytes"],
        "peak_memory_kind": m["peak_memory_kind"],
        "reference": m.get("reference"),
        "reward_history": m["reward_history"],
        "seconds_per_step": m["seconds_per_step"],
    }


def render_cases(run: common.Run) -> str:
    def phase(key: str):
        def cell(row: common.Row) -> str:
            measured, predicted = row.get(key), (row.get("estimate") or {}).get(key)
            text = common.shown(measured, common.mib)
            if isinstance(measured, int) and isinstance(predicted, int) and measured:
                text += f" ({common.mib(predicted)}, {(predicted - measured) / measured:+.1%})"
            return text

        return cell

    def reference(row: common.Row) -> str:
        ref = row.get("reference") or {}
        return (
            f"{ref['how']} {ref.get('dtype') or ''}: {common.mib(ref.get('bytes') or 0)}"
            if ref
            else "–"
        )

    columns = [
        common.Column("case", lambda r: CASES[r["row"]][0] if r["row"] in CASES else r["row"], right=False),
        common.Column("generation (est., error)", phase("generation_peak_bytes")),
        common.Column("training (est., error)", phase("training_peak_bytes")),
        common.Column("run's peak", lambda r: common.shown(r.get("peak_memory_bytes"), common.mib)),
        common.Column("reference", reference, right=False),
        common.Column("s/step", lambda r: common.shown(r.get("seconds_per_step"), common.seconds)),
        common.Column("mean reward", lambda r: f"{statistics.fmean(r['reward_history'] or [math.nan]):.3f}"),
    ]  # fmt: skip
    refused = [
        f"- {CASES.get(r['row'], (r['row'],))[0]}: {r['estimate']['refused']}"
        for r in run["rows"]
        if (r.get("estimate") or {}).get("refused")
    ]
    return "\n\n".join(
        [common.markdown_table(columns, run["rows"]), *(["\n".join(refused)] if refused else [])]
    )


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def summarize(configuration, runs: list[dict]) -> common.Row:
    """One process's numbers, the same keys for both sides."""
    m = runs[0]
    side, _, seed = configuration.label.partition("-seed")
    row = {
        "row": configuration.label,
        "side": side,
        "seed": int(seed),
        "reward_history": m["reward_history"],
        "steps": len(m["reward_history"]),
        "seconds_per_step": m["seconds_per_step"],
        "peak_rss_bytes": common.process_peak(runs),
        "wall_seconds": m["process"]["wall_seconds"],
    }
    if side == "trl":  # TRL logs each step's lr; effitrain's is its schedule (test_schedule.py)
        row |= {"lr_history": m["lr_history"], "torch_threads": m["torch_threads"]}
    return row


# --------------------------------------------------------------------------------------------
# Rendering: every number below is computed from the recorded reward histories
# --------------------------------------------------------------------------------------------


def ends(history: list[float]) -> tuple[float, float]:
    """The mean reward of the first and of the last :data:`WINDOW` steps."""
    return statistics.fmean(history[:WINDOW]), statistics.fmean(history[-WINDOW:])


def steps_to(history: list[float], level: float) -> int | None:
    """The first step at which the mean of the last :data:`WINDOW` steps reaches ``level``
    (how fast the curve rises); None if it never does."""
    for step in range(WINDOW, len(history) + 1):
        if statistics.fmean(history[step - WINDOW : step]) >= level:
            return step
    return None


def goal(effitrain: list[list[float]], trl: list[list[float]]) -> dict[str, float | bool]:
    """The goal over one or several seeds' histories (each side's ends averaged over them):
    effitrain's rise as a share of TRL's, and its last mean minus TRL's."""
    ours = [ends(h) for h in effitrain]
    theirs = [ends(h) for h in trl]
    rise = statistics.fmean(b - a for a, b in ours)
    trl_rise = statistics.fmean(b - a for a, b in theirs)
    gap = statistics.fmean(b for _, b in ours) - statistics.fmean(b for _, b in theirs)
    share = rise / trl_rise if trl_rise > 0 else float("nan")
    return {"share": share, "gap": gap, "met": share >= RISE_SHARE and gap >= -LAST_GAP}


def _pairs(rows: list[common.Row]) -> dict[int, dict[str, common.Row]]:
    """seed -> side -> row."""
    by_seed: dict[int, dict[str, common.Row]] = {}
    for row in rows:
        by_seed.setdefault(row["seed"], {})[row["side"]] = row
    return by_seed


def render(run: common.Run) -> str:
    if run["settings"].get("what") == "cases":
        return render_cases(run)
    rows = run["rows"]
    pairs = _pairs(rows)
    return "\n\n".join(
        [_runs_table(rows, pairs), _goal_table(pairs), _curve_table(rows), _settings_line(run)]
    )


def _runs_table(rows: list[common.Row], pairs: dict[int, dict[str, common.Row]]) -> str:
    def against_trl(row: common.Row, key: str, fmt) -> str:
        base = pairs[row["seed"]].get("trl", row)
        return common.with_ratio(row, base, key, fmt)

    columns = [
        common.Column("run", lambda r: f"{_side_name(r['side'])}, seed {r['seed']}", right=False),
        common.Column("first 10 steps", lambda r: f"{ends(r['reward_history'])[0]:.3f}"),
        common.Column("last 10 steps", lambda r: f"{ends(r['reward_history'])[1]:.3f}"),
        common.Column("rise", lambda r: f"{_rise(r):+.3f}"),
        common.Column(
            f"steps to a 10-step mean ≥ {HALFWAY}",
            lambda r: common.shown(steps_to(r["reward_history"], HALFWAY), str),
        ),
        common.Column("peak RSS", lambda r: against_trl(r, "peak_rss_bytes", common.mib)),
        common.Column("s/step", lambda r: against_trl(r, "seconds_per_step", common.seconds)),
        common.Column("wall", lambda r: f"{r['wall_seconds']:.0f} s"),
    ]
    return (
        "Mean reward of each step's 16 completions (effitrain's `reward_history`, TRL's logged "
        "`reward`), over the first and the last 10 steps; ratios are to TRL's run of the same "
        "seed:\n\n" + common.markdown_table(columns, rows)
    )


def _side_name(side: str) -> str:
    return {"effitrain": "effitrain `--task grpo`", "trl": "TRL `GRPOTrainer`"}[side]


def _rise(row: common.Row) -> float:
    first, last = ends(row["reward_history"])
    return last - first


def _goal_table(pairs: dict[int, dict[str, common.Row]]) -> str:
    complete = {seed: p for seed, p in pairs.items() if {"effitrain", "trl"} <= set(p)}
    lines = [(f"seed {seed}", goal([p["effitrain"]["reward_history"]], [p["trl"]["reward_history"]]))
             for seed, p in complete.items()]  # fmt: skip
    if len(complete) > 1:
        overall = goal([p["effitrain"]["reward_history"] for p in complete.values()],
                       [p["trl"]["reward_history"] for p in complete.values()])  # fmt: skip
        lines.append((f"over the {len(complete)} seeds (means)", overall))
    columns = [
        common.Column("", lambda r: r[0], right=False),
        common.Column(f"effitrain's rise / TRL's (≥ {RISE_SHARE:.0%})", lambda r: f"{r[1]['share']:.0%}"),
        common.Column(f"effitrain's last − TRL's (≥ −{LAST_GAP})", lambda r: f"{r[1]['gap']:+.3f}"),
        common.Column("goal", lambda r: "met" if r[1]["met"] else "**missed**"),
    ]  # fmt: skip
    return "The issue's learning goal:\n\n" + common.markdown_table(columns, lines)


def _curve_table(rows: list[common.Row]) -> str:
    steps = min(len(r["reward_history"]) for r in rows)
    width = max(1, steps // CURVE_POINTS)
    windows = [(start, min(start + width, steps)) for start in range(0, steps, width)]
    windows = windows[:CURVE_POINTS]
    columns = [common.Column("run", lambda r: f"{r['side']}, seed {r['seed']}", right=False)]
    columns += [
        common.Column(
            f"{a + 1}–{b}",
            lambda r, a=a, b=b: f"{statistics.fmean(r['reward_history'][a:b]):.2f}",
        )
        for a, b in windows
    ]
    return f"The reward curves: mean reward over each {width} steps:\n\n" + common.markdown_table(
        columns, rows
    )


def _settings_line(run: common.Run) -> str:
    s = run["settings"]
    return (
        f"Both sides: {s['model']}, {s['prompts']}, reward `{s['reward']}`; G "
        f"{s['num_generations']}, {s['max_completion_length']} completion tokens, batch "
        f"{s['batch_size']} completions, AdamW lr {common.lr_text(s['lr'])}, linear schedule "
        f"with {s['warmup_steps']} warmup steps, weight decay {s['weight_decay']:g}, "
        f"{s['steps']} optimizer steps, {s['torch_threads']} torch thread(s) per process."
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--what", choices=["trl", "cases"], default="trl", help="beside TRL, "
                        "or effitrain's cases alone (the GPU variant)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps a run")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--model", default="qwen2.5-0.5b", help="cases")
    parser.add_argument("--completion-length", type=int, default=32, help="cases")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
        help="torch threads per process, both sides (default: OMP_NUM_THREADS, else 1)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
