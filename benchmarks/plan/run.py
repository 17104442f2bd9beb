"""Does ``effitrain plan`` find what fits, fast, and does what it prints fit when run?

Two runs. ``shapes``: the plan for three published shapes (Llama-3.2-1B, Llama-3.1-8B,
Qwen2.5-7B: their config.json, as ``benchmarks/llm_shapes`` writes them) at 1 x 2048 tokens for
a CUDA card of 16, 24, 48 and 80 GiB, each ``effitrain plan --device cuda --json`` in a fresh
process: the best full-parameter and the best adapter configuration, and how long the plan took
(imports included). ``cpu-check``: the plan for ``qwen2.5-0.5b`` at 1 x 1024 tokens and a CPU
budget, then its first three candidates trained for a few steps each (``effitrain train
--max-steps``, a fresh process each): the measured peak tensor memory against the budget, and
the measured seconds per step in the order the plan predicted.

    python -m benchmarks.plan.run --name shapes
    python -m benchmarks.plan.run --name cpu-check --budget 3GiB
    python -m benchmarks.plan.run --render
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.llm_shapes.run import MODELS, write_config

TOPIC = common.Topic.of(__file__)
BUDGETS_GIB = (16, 24, 48, 80)
SHAPE_SETTING = ["--batch-size", "1", "--max-length", "2048"]
CPU_MODEL = ["--task", "causal-lm", "--model", "qwen2.5-0.5b", "--batch-size", "1"]
CPU_MODEL += ["--max-length", "1024"]
CPU_STEPS = 4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def effitrain(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "effitrain", *args],
        capture_output=True, text=True, env=ENV, cwd=common.REPO,
    )  # fmt: skip
    return proc, time.monotonic() - start


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return (lines or proc.stderr.strip().splitlines()[-1:] or ["no output"])[0]


def plan_row(model: str, folder: Path, gib: int) -> common.Row:
    """One plan: the best candidate of each kind, or the plan's refusal."""
    args = ["--task", "causal-lm", "--model", str(folder), *SHAPE_SETTING, "--device", "cuda"]
    proc, seconds = effitrain("plan", *args, "--memory", f"{gib}GiB", "--json")
    row: common.Row = {"model": model, "budget_gib": gib, "seconds": round(seconds, 1)}
    if proc.returncode != 0:
        return {**row, "refused": error_line(proc).removeprefix("error:").strip()}
    result = json.loads(proc.stdout)
    row["estimates"] = result["estimates"]
    for kind, full in (("full", True), ("adapters", False)):
        best = next((c for c in result["candidates"] if c["full_parameter"] == full), None)
        if best is not None:
            row[kind] = {k: best[k] for k in ("args", "peak_tensor_bytes", "verified")}
    return row


def measure_shapes(args: Any) -> common.Run:
    rows = []
    for model in MODELS:
        folder = write_config(args.work_dir / "models", model)
        for gib in BUDGETS_GIB:
            print(f"{model} at {gib} GiB", file=sys.stderr, flush=True)
            rows.append(plan_row(model, folder, gib))
    return {
        "name": "shapes",
        "title": "plans for published shapes at 1 × 2048 tokens, for a CUDA card, planned on this CPU",
        "settings": {"budgets_gib": list(BUDGETS_GIB), "options": SHAPE_SETTING},
        "rows": rows,
        "notes": [],
    }


def measure_cpu(args: Any) -> common.Run:
    """The plan on this CPU, then its first three candidates trained."""
    proc, seconds = effitrain("plan", *CPU_MODEL, "--memory", args.budget, "--json")
    if proc.returncode != 0:
        raise SystemExit(f"the plan failed: {error_line(proc)}")
    result = json.loads(proc.stdout)
    rows = []
    for rank, candidate in enumerate(result["candidates"][:3], start=1):
        metrics = args.work_dir / f"cpu-{rank}.json"
        print(f"candidate {rank}: {' '.join(candidate['args'])}", file=sys.stderr, flush=True)
        run, _ = effitrain(
            "train", *CPU_MODEL, *candidate["args"], "--max-steps", str(CPU_STEPS), "--quiet",
            "--metrics-json", str(metrics),
        )  # fmt: skip
        row: common.Row = {
            "rank": rank,
            "args": candidate["args"],
            "planned_peak_bytes": candidate["peak_tensor_bytes"],
            "verified": candidate["verified"],
            "relative_step_time": candidate["relative_step_time"],
        }
        if run.returncode != 0:
            rows.append({**row, "failed": error_line(run)})
            continue
        measured = json.loads(metrics.read_text())
        row["measured_peak_bytes"] = measured["peak_tensor_bytes"]
        row["seconds_per_step"] = measured["seconds_per_step"]
        rows.append(row)
    return {
        "name": "cpu-check",
        "title": f"qwen2.5-0.5b at 1 × 1024 tokens within {args.budget}, planned and run on this CPU",
        "settings": {
            "budget": args.budget,
            "budget_bytes": result["budget_bytes"],
            "options": CPU_MODEL,
            "steps": CPU_STEPS,
            "plan_seconds": round(seconds, 1),
            "plan_estimates": result["estimates"],
        },
        "rows": rows,
        "notes": [],
        "failed": any("failed" in r for r in rows),
    }


def measure(args: Any, device: str) -> common.Run:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return measure_cpu(args) if args.name == "cpu-check" else measure_shapes(args)


def _config(candidate: dict[str, Any] | None) -> str:
    if candidate is None:
        return "–"
    return f"`{' '.join(candidate['args'])}`"


def _peak(candidate: dict[str, Any] | None) -> str:
    if candidate is None:
        return "–"
    return common.size(candidate["peak_tensor_bytes"]) + (
        "" if candidate["verified"] else " (screened)"
    )


def render_shapes(run: common.Run) -> str:
    columns = [
        common.Column("model", lambda r: r["model"], right=False),
        common.Column("budget", lambda r: f"{r['budget_gib']} GiB"),
        common.Column("best full-parameter", lambda r: _config(r.get("full")), right=False),
        common.Column("its peak", lambda r: _peak(r.get("full"))),
        common.Column("best with adapters", lambda r: _config(r.get("adapters")), right=False),
        common.Column("its peak", lambda r: _peak(r.get("adapters"))),
        common.Column("estimates", lambda r: str(r.get("estimates", "–"))),
        common.Column("plan took", lambda r: f"{r['seconds']:.0f} s"),
    ]
    table = common.markdown_table(columns, run["rows"])
    refused = [
        f"- {r['model']} at {r['budget_gib']} GiB: {r['refused']}"
        for r in run["rows"]
        if "refused" in r
    ]
    return "\n\n".join([table, *(["\n".join(refused)] if refused else [])])


MODELED_TIE = 0.05
"""Candidates the plan models this close are a tie: it predicts no order between them."""
MEASURED_TIE = 0.10
"""Candidates measured this close are a tie: this shared machine's repeats differ that much."""


def _pairs_in_order(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Of every pair of rows (plan's order): how many are measured in that order, how many
    pairs, how many of them ties (counted as in order)."""
    ordered = pairs = ties = 0
    for i, first in enumerate(rows):
        for second in rows[i + 1 :]:
            pairs += 1
            modeled = second["relative_step_time"] / first["relative_step_time"] - 1
            a, b = first["seconds_per_step"], second["seconds_per_step"]
            if modeled < MODELED_TIE or abs(b - a) / min(a, b) < MEASURED_TIE:
                ties += 1
                ordered += 1
            elif a <= b:
                ordered += 1
    return ordered, pairs, ties


def render_cpu(run: common.Run) -> str:
    settings = run["settings"]
    budget = settings["budget_bytes"]
    columns = [
        common.Column("plan's rank", lambda r: str(r["rank"])),
        common.Column("options the plan chose", lambda r: f"`{' '.join(r['args'])}`", right=False),
        common.Column("planned peak", lambda r: common.size(r["planned_peak_bytes"])),
        common.Column("measured peak", lambda r: common.shown(r.get("measured_peak_bytes"), common.size)),
        common.Column("≤ budget", lambda r: "yes" if r.get("measured_peak_bytes", budget + 1) <= budget else "no"),
        common.Column("planned time", lambda r: f"×{r['relative_step_time']:.2f}"),
        common.Column("measured s/step", lambda r: common.shown(r.get("seconds_per_step"), "{:.2f}".format)),
    ]  # fmt: skip
    table = common.markdown_table(columns, run["rows"])
    ran = [r for r in run["rows"] if "seconds_per_step" in r]
    fits = all(r["measured_peak_bytes"] <= budget for r in ran) and len(ran) == len(run["rows"])
    ordered, pairs, ties = _pairs_in_order(ran)
    verdict = (
        f"The plan took {settings['plan_seconds']:.0f} s ({settings['plan_estimates']} fake-tensor "
        f"estimates). Every candidate's measured peak within the budget: {'yes' if fits else 'no'}. "
        f"Pairs of candidates whose measured s/step are in the plan's order: {ordered} of {pairs} "
        f"({ties} of them ties: modeled within {MODELED_TIE:.0%} or measured within "
        f"{MEASURED_TIE:.0%} of each other, either order counts)."
    )
    return "\n\n".join([table, verdict])


def render(run: common.Run) -> str:
    return render_cpu(run) if run["name"] == "cpu-check" else render_shapes(run)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--budget", default="3GiB", help="cpu-check's budget (default 3GiB)")
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
