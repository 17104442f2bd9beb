"""Does the time model order configurations as their measured times do?

For every row of the lever benchmarks' recorded runs (``benchmarks/levers``: distilbert-base at
8 x 128 tokens, on this CPU and on an H200; ``benchmarks/llm_levers``: qwen2.5-0.5b at 1 x 2048
tokens on this CPU), the row's own ``effitrain train`` options are estimated here, on fake
tensors, for their step's cost (``effitrain.cost.StepCost``: FLOPs, recompute, the part in
bf16, elementwise bytes, operator calls, offload bytes), and the nominal time model
(``effitrain.cost.modeled_step_seconds``, for the device type the run measured on) predicts a
time per step. Per run: each row's modeled and measured time as ratios to the first row, and
whether the model puts the rows in the measured order (Spearman's rank correlation and the pairs
of rows ordered alike). Pairs whose measured times are within the run's noise (``NOISE``) are
ties: either order counts. Nothing is trained: the measured times are the recorded ones.

    python -m benchmarks.cost.run                 # every recorded lever run (a few minutes)
    python -m benchmarks.cost.run --sources levers:cpu
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

from benchmarks import common

TOPIC = common.Topic.of(__file__)
SOURCES = ("levers:cpu", "levers:gpu", "llm_levers:cpu")
"""``topic:run name`` of the recorded runs whose rows are modeled."""
NOISE = 0.10
"""Measured times closer than this (relative) are ties: the recorded runs ran once or twice on a
shared machine, where repeats differ by about this much."""
GPU_ARGS: list[str] = []
SMOKE_ARGS = ["--sources", "levers:cpu", "--model", "tiny"]
"""A trial: the plumbing on the tiny preset (its modeled times mean nothing against the
recorded distilbert-base ones)."""


def source_options(topic: str, run: common.Run, work_dir: Any, model: str | None) -> list[str]:
    """The options every row of ``run`` shared, as its benchmark gave them (with data files of
    the same shape written under ``work_dir``)."""
    settings = run["settings"]
    model = model or settings["model"]
    length = settings["max_length"]
    if topic == "levers":
        train, validation = common.write_long_texts(work_dir / "data", rows=settings["batch_size"])
        options = ["--model", model, "--train-file", str(train), "--validation-file"]
        return [*options, str(validation), "--batch-size", str(settings["batch_size"]),
                "--max-length", str(length)]  # fmt: skip
    options = ["--task", "causal-lm", "--model", model, "--batch-size", "1"]
    options += ["--max-length", str(length)]
    if run["name"] != "cpu":
        options += ["--mixed-precision", "bf16"]  # as benchmarks/llm_levers runs on a GPU
    return options


def model_row(topic: str, recorded: dict[str, Any], shared: list[str], device: str) -> dict:
    """One recorded row, estimated for its cost and modeled."""
    import importlib

    from effitrain.cli.compare import train_config
    from effitrain.cost import modeled_step_seconds
    from effitrain.estimation import estimate

    rows = importlib.import_module(f"benchmarks.{topic}.run").ROWS
    cost = estimate(train_config([*shared, *rows[recorded["row"]]])).cost
    return {
        "row": recorded["row"],
        "seconds_per_step": recorded["seconds_per_step"],
        "modeled_seconds": modeled_step_seconds(cost, device),
        **cost.to_dict(),
    }


def agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman's rank correlation of modeled and measured times, and the pairs of rows the
    model orders as measured (ties within :data:`NOISE` count as agreeing either way)."""
    measured = [row["seconds_per_step"] for row in rows]
    modeled = [row["modeled_seconds"] for row in rows]
    pairs = agree = ties = 0
    disagreeing = []
    for i, j in itertools.combinations(range(len(rows)), 2):
        pairs += 1
        if abs(measured[i] - measured[j]) <= NOISE * max(measured[i], measured[j]):
            ties += 1
            agree += 1
        elif (measured[i] < measured[j]) == (modeled[i] < modeled[j]):
            agree += 1
        else:
            disagreeing.append(f"{rows[i]['row']} / {rows[j]['row']}")
    return {
        "spearman": _spearman(measured, modeled),
        "pairs": pairs,
        "agreeing_pairs": agree,
        "tied_pairs": ties,
        "disagreeing": disagreeing,
    }


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    return ranks


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def measure_source(source: str, args: argparse.Namespace) -> common.Run:
    topic, name = source.split(":")
    recorded_topic = common.Topic(topic)
    data = common.load_results(recorded_topic.results, recorded_topic)
    recorded = next((run for run in data["runs"] if run["name"] == name), None)
    if recorded is None:
        raise SystemExit(f"error: benchmarks/{topic} has no run named {name}")
    device = "cpu" if name == "cpu" else "cuda"
    shared = source_options(topic, recorded, args.work_dir / topic, args.model)
    rows = []
    base = recorded["rows"][0]["seconds_per_step"]
    for row in recorded["rows"]:
        print(f"{source}: {row['row']}", file=sys.stderr, flush=True)
        row = {**row, "seconds_per_step": _seconds(row["seconds_per_step"], base)}
        rows.append(model_row(topic, row, shared, device))
    return {
        "name": source.replace(":", "-"),
        "title": f"benchmarks/{topic}: {recorded['title']}",
        "settings": {"source": source, "device_type": device, "noise": NOISE},
        "rows": rows,
        "agreement": agreement(rows),
        "notes": [
            f"measured: benchmarks/{topic}'s run '{name}' ({recorded['provenance']['date']}, "
            f"{recorded['settings'].get('repeats', 1)} repeat(s))"
        ],
    }


def _seconds(cell: Any, base: Any) -> float:
    """A recorded time: a number, or a run transcribed from a README as its cell ("0.04
    (1.70×)": the ratio to the first row is the precise part, its seconds are rounded)."""
    if not isinstance(cell, str):
        return float(cell)
    if "(" in cell:
        return _seconds(base, base) * float(cell.split("(")[1].split("×")[0])
    return float(cell)


def _ratio(row: dict, base: dict, key: str) -> str:
    return f"{row[key] / base[key]:.2f}×"


def render(run: common.Run) -> str:
    rows = run["rows"]
    base = rows[0]
    columns = [
        common.Column("row", lambda row: row["row"], right=False),
        common.Column("FLOPs/step", lambda row: f"{row['flops_per_step'] / 1e9:,.1f} G"),
        common.Column(
            "recompute", lambda row: f"{row['recompute_flops'] / row['flops_per_step']:.0%}"
        ),
        common.Column(
            "in bf16", lambda row: f"{row['half_precision_flops'] / row['flops_per_step']:.0%}"
        ),
        common.Column("other bytes", lambda row: common.mib(row["elementwise_bytes"])),
        common.Column("operators", lambda row: f"{row['operator_calls']:,}"),
        common.Column("modeled", lambda row: _ratio(row, base, "modeled_seconds")),
        common.Column("measured", lambda row: _ratio(row, base, "seconds_per_step")),
    ]
    table = common.markdown_table(columns, rows)
    fit = run["agreement"]
    verdict = (
        f"**Order:** Spearman {fit['spearman']:.2f}; {fit['agreeing_pairs']} of {fit['pairs']} "
        f"pairs of rows ordered as measured ({fit['tied_pairs']} of them measured within "
        f"{run['settings']['noise']:.0%} of each other: ties)"
    )
    if fit["disagreeing"]:
        verdict += "; ordered otherwise: " + "; ".join(fit["disagreeing"])
    return f"{table}\n\n{verdict}."


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--model", help="estimate this model instead of the recorded one")
    args = parser.parse_args(argv)
    if args.render or args.check:
        return common.render_readme(TOPIC, render, check=args.check)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    for source in args.sources:
        run = measure_source(source, args)
        run["provenance"] = common.provenance(TOPIC, sys.argv[1:] if argv is None else argv, "cpu")
        common.record(args.results, TOPIC, run)
        print(f"### {run['title']}\n\n{render(run)}\n", flush=True)
    if args.results.resolve() == TOPIC.results.resolve():
        common.render_readme(TOPIC, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
