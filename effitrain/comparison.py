"""``effitrain compare``: several configurations on the same model and data, side by side.

Each configuration (an optimizer, or a variant ``"adafactor +gradient-checkpointing"``) is one
``effitrain train`` in a fresh process (so each process's peak RSS is its own), with
``--metrics-json``; with repeats, the configurations run in turn (A B C A B C …) so machine noise
hits each alike. The rows keep each run's measured numbers under the metrics JSON's own names;
time per step is the median over repeats. Written to the output folder: ``compare.json`` (every
row and every run), ``compare.csv`` (one line per configuration) and ``compare.png`` (stacked
memory bars and the loss curves; matplotlib, the ``plot`` extra).

The benchmarks (``benchmarks/``) run their configurations through the same runner: a
configuration may set its own environment or a baseline ``program`` that is not effitrain, and
:func:`compare` takes callbacks for what a benchmark derives from each run.

Heavy imports (matplotlib) happen inside functions.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain.errors import EffitrainError
from effitrain.report.comparison_table import COLUMNS, PARTS

DEFAULT_OPTIMIZERS = ("adamw", "adafactor", "adamw-8bit")
"""The default comparison: AdamW against its two memory-saving rivals, Adafactor and 8-bit AdamW."""


@dataclass
class Configuration:
    """One row: a label and the ``effitrain train`` options that make it."""

    label: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for this configuration's process only (e.g. a thread count)."""
    program: list[str] | None = None
    """What runs it instead of ``python -m effitrain train --quiet``: a baseline that is not
    effitrain (a plain loop, the Trainer). It gets the same arguments (the common options,
    ``args``, ``--metrics-json PATH``) and must write a JSON object with ``seconds_per_step``
    to that path."""

    def command(self, common: list[str], metrics_path: Path) -> list[str]:
        """The command line of one run of this configuration."""
        program = self.program or [sys.executable, "-m", "effitrain", "train", "--quiet"]
        return [*program, *common, *self.args, "--metrics-json", str(metrics_path)]


def parse_variant(text: str) -> Configuration:
    """``"adafactor +gradient-checkpointing +lora-rank=8"`` -> ``--optim adafactor
    --gradient-checkpointing --lora-rank 8``: an optimizer name, then ``+option`` or
    ``+option=value`` for any ``effitrain train`` option.

    Raises:
        EffitrainError: empty, or a word that is neither the first nor ``+option``.
    """
    words = text.split()
    if not words or words[0].startswith("+"):
        raise EffitrainError(
            f"--variant '{text}': start with an optimizer name, then +options, e.g. "
            "'adafactor +gradient-checkpointing'"
        )
    args = ["--optim", words[0]]
    for word in words[1:]:
        if not word.startswith("+") or len(word) == 1:
            raise EffitrainError(
                f"--variant '{text}': '{word}' is not a +option (e.g. +gradient-checkpointing "
                "or +lora-rank=8)"
            )
        name, _, value = word[1:].partition("=")
        args += [f"--{name}", value] if value else [f"--{name}"]
    return Configuration(label=" ".join(words), args=args)


def configurations(optims: list[str], variants: list[str]) -> list[Configuration]:
    """The rows, in order: each optimizer, then each variant; :data:`DEFAULT_OPTIMIZERS` by default
    (8-bit AdamW only where bitsandbytes is installed)."""
    from effitrain.optim import get_spec

    if not optims and not variants:
        optims = [name for name in DEFAULT_OPTIMIZERS if get_spec(name).is_available()]
    for name in optims:
        get_spec(name)  # an unknown name: one line listing the valid ones
    rows = [Configuration(label=name, args=["--optim", name]) for name in optims]
    rows += [parse_variant(v) for v in variants]
    labels = [row.label for row in rows]
    if len(set(labels)) != len(labels):
        raise EffitrainError(f"the same configuration is asked for twice: {', '.join(labels)}")
    return rows


def run_process(
    command: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, float | None]]:
    """Run ``command`` to its end: its output, and its wall time and peak RSS as the kernel
    counted them for that process (``wait4``), the same measure whatever program it is."""
    if not hasattr(os, "wait4"):  # Windows: no per-process peak to read
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        return proc, {"wall_seconds": time.perf_counter() - start, "peak_rss_bytes": None}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    # ru_maxrss is in bytes on macOS, in KiB on Linux.
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return proc, {"wall_seconds": wall, "peak_rss_bytes": peak}


def run_one(
    configuration: Configuration, common: list[str], metrics_path: Path
) -> tuple[dict[str, Any] | None, str]:
    """One ``effitrain train`` (or the configuration's own program) in a fresh process: its
    metrics, with the process's wall time, peak RSS and output file under ``process``, or None
    and its error line. Its output is kept beside the metrics (``.log``)."""
    command = configuration.command(common, metrics_path)
    proc, usage = run_process(command, {**os.environ, **configuration.env})
    log = metrics_path.with_suffix(".log")
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None, child_error(proc.stderr, proc.returncode)
    metrics = {**json.loads(metrics_path.read_text()), "process": {**usage, "output": str(log)}}
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")  # the file as compare.json has it
    return metrics, ""


BOX = "╭╰│─"
"""The border characters of a rich panel (typer's boxed usage errors)."""


def child_error(stderr: str, returncode: int) -> str:
    """The reason a child run failed, from its stderr: its ``error:`` line; else the text of a
    boxed error (a panel's inner lines, joined); else a traceback's last line; else the last
    line; else how it ended (a negative code: killed by that signal)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1]
    boxed = [line.strip(BOX + " ") for line in lines if line[:1] == "│"]
    if any(boxed):
        return " ".join(part for part in boxed if part)
    text = [line for line in lines if line[:1] not in BOX]
    if text:
        return text[-1]
    if returncode < 0:
        import signal

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exit code {returncode}"


def summarize(configuration: Configuration, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a configuration's runs: bytes from the first (they repeat exactly), time
    and peak RSS the median over runs."""
    first = runs[0]
    row: dict[str, Any] = {
        "label": configuration.label,
        "args": configuration.args,
        "optimizer": first["optimizer"],
        "levers": first.get("levers", []),
        "parameter_bytes": first["parameter_bytes"],
        "gradient_bytes": first["gradient_bytes"],
        "optimizer_state_bytes": first["optimizer_state"]["bytes"],
        "optimizer_state_elements": first["optimizer_state"]["elements"],
        "activation_bytes": first.get("activation_bytes") or 0,
        "peak_tensor_bytes": first.get("peak_tensor_bytes") or 0,
        "peak_memory_bytes": statistics.median(r["peak_memory_bytes"] for r in runs),
        "peak_memory_kind": first["peak_memory_kind"],
        "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
        "flops_per_step": first.get("flops_per_step"),
        "achieved_tflops": _median(r.get("achieved_tflops") for r in runs),
        "mfu": _median(r.get("mfu") for r in runs),
        "final_loss": (first.get("loss_history") or [{"loss": first["train_loss"]}])[-1]["loss"],
        "eval_accuracy": first["eval"].get("accuracy"),
        "eval_perplexity": first["eval"].get("perplexity"),
        "eval_reward_accuracy": first["eval"].get("rewards/accuracies"),
        "loss_history": first.get("loss_history", []),
        "repeats": len(runs),
    }
    return row


def _median(values: Iterable[float | None]) -> float | None:
    """The median, or None where a run has none (no FLOPs counted, no known peak)."""
    known = list(values)
    return None if not known or None in known else statistics.median(known)


@dataclass
class Comparison:
    rows: list[dict[str, Any]]
    failed: dict[str, str]
    """Label -> the error line of a configuration that did not run."""
    runs: dict[str, list[dict[str, Any]]]


def compare(
    rows: list[Configuration],
    common: list[str],
    output_dir: Path,
    repeats: int = 1,
    progress: Callable[[str], None] = lambda _line: None,
    *,
    summarize: Callable[[Configuration, list[dict[str, Any]]], dict[str, Any]] = summarize,
    on_run: Callable[[Configuration, dict[str, Any]], None] | None = None,
    alternate: bool = False,
    jobs: int = 1,
) -> Comparison:
    """Run every configuration ``repeats`` times, in turn (A B C A B C), so that machine noise
    hits each alike; a configuration that fails is reported (its error line) and not run again.

    Args:
        summarize: a configuration's runs -> its row (default: the metrics JSON's fields).
        on_run: sees each successful run's metrics before they are kept, and may add to them.
        alternate: every other repeat runs in reverse order (A B C C B A), so that a drift
            over the session hits each alike as well.
        jobs: how many runs of one repeat at once; above 1, for memory and accuracy only
            (the runs share the machine, so their times mean little).
    """
    runs_dir = output_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {row.label: [] for row in rows}
    failed: dict[str, str] = {}
    total = len(rows) * repeats

    def turn(item: tuple[int, int, Configuration]) -> tuple[dict[str, Any] | None, str]:
        index, repeat, row = item
        tag = f"[{index}/{total}] {row.label}"
        progress(f"{tag}: running")
        slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in row.label)
        metrics, error = run_one(row, common, runs_dir / f"{repeat + 1}-{slug}.json")
        if metrics is None:
            progress(f"{tag}: failed ({error})")
            return None, error
        if on_run is not None:
            on_run(row, metrics)
        progress(f"{tag}: {_run_line(metrics)}")
        return metrics, ""

    from concurrent.futures import ThreadPoolExecutor

    for repeat in range(repeats):
        order = rows[::-1] if alternate and repeat % 2 else rows
        todo = [
            (repeat * len(rows) + i + 1, repeat, row)
            for i, row in enumerate(order)
            if row.label not in failed
        ]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for (_, _, row), (metrics, error) in zip(todo, pool.map(turn, todo), strict=True):
                if metrics is None:
                    failed[row.label] = error
                else:
                    runs[row.label].append(metrics)
    summary = [summarize(row, runs[row.label]) for row in rows if runs[row.label]]
    return Comparison(rows=summary, failed=failed, runs=runs)


def _run_line(metrics: dict[str, Any]) -> str:
    """What a finished run's progress line says."""
    from effitrain.memory.ledger import format_bytes

    parts = []
    if metrics.get("peak_tensor_bytes"):
        parts.append(f"peak tensors {format_bytes(metrics['peak_tensor_bytes'])}")
    if metrics.get("seconds_per_step") is not None:
        parts.append(f"{metrics['seconds_per_step']:.2f} s/step")
    parts.append(f"done in {metrics['process']['wall_seconds']:.0f} s")
    return ", ".join(parts)


def write_files(comparison: Comparison, output_dir: Path, common: list[str]) -> dict[str, Path]:
    """``compare.json``, ``compare.csv`` and, with matplotlib, ``compare.png``; returns what
    was written."""
    written = {}
    data = {
        "options": common,
        "rows": comparison.rows,
        "failed": comparison.failed,
        "runs": comparison.runs,
    }
    path = output_dir / "compare.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    written["json"] = path
    path = output_dir / "compare.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["configuration", *(key for _, key in COLUMNS), "repeats"])
        for row in comparison.rows:
            writer.writerow([row["label"], *(row[key] for _, key in COLUMNS), row["repeats"]])
    written["csv"] = path
    if comparison.rows and plotting_available():
        path = output_dir / "compare.png"
        plot(data, path)
        written["png"] = path
    return written


def plotting_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _unit(largest: float) -> tuple[float, str]:
    return (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")


def plot(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Stacked memory bars per configuration and the loss curves, from ``compare.json``'s data
    only. Returns what was drawn (bar heights in the chosen unit, curves), for tests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    labels = [row["label"] for row in rows]
    largest = max(sum(row[key] for _, key in PARTS) for row in rows)
    scale, unit = _unit(largest)
    fig, (bars, curves) = plt.subplots(
        1, 2, figsize=(max(10.0, 3.0 + 1.6 * len(rows)), 5.0), constrained_layout=True
    )
    drawn: dict[str, Any] = {"unit": unit, "bars": {}, "curves": {}}
    positions = range(len(rows))
    bottom = [0.0] * len(rows)
    for name, key in PARTS:
        heights = [row[key] / scale for row in rows]
        bars.bar(positions, heights, bottom=bottom, label=name, width=0.6)
        drawn["bars"][name] = heights
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    peaks = [row["peak_tensor_bytes"] / scale for row in rows]
    bars.hlines(
        peaks, [x - 0.38 for x in positions], [x + 0.38 for x in positions], colors="black",
        linewidths=2, label="line: the step's peak (all at once)",
    )  # fmt: skip
    drawn["peak_tensors"] = peaks
    from effitrain.memory.ledger import format_bytes

    for x, total, peak, row in zip(positions, bottom, peaks, rows, strict=True):
        bars.annotate(
            format_bytes(row["peak_tensor_bytes"]), (x, max(total, peak)), ha="center",
            va="bottom", fontsize=9, xytext=(0, 3), textcoords="offset points",
        )  # fmt: skip
    bars.set_xticks(list(positions), [label.replace(" +", "\n+") for label in labels], fontsize=9)
    bars.set_ylabel(f"memory in one optimizer step ({unit})")
    bars.set_title("Tensor memory in one optimizer step")
    top = max([*bottom, *peaks])
    bars.set_ylim(0, top * 1.4 if top > 0 else 1)
    # The parts peak at different moments of the step: stacked, they can pass the peak.
    bars.legend(
        loc="upper right",
        fontsize=9,
        title="bars: each part at its own peak, stacked\n(so they can pass the line)",
        title_fontsize=8,
    )
    legend = bars.get_legend()
    drawn["legend"] = [text.get_text() for text in legend.get_texts()]
    drawn["bars_title"] = legend.get_title().get_text()
    drawn["curves"], drawn["curve_labels"] = _draw_curves(curves, rows)
    drawn["loss_axis"] = curves.get_ylim()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def _coincide(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    """Whether two loss curves would hide each other: the same steps, losses within 0.1%."""
    return (
        bool(a[0])
        and a[0] == b[0]
        and all(math.isclose(x, y, rel_tol=1e-3) for x, y in zip(a[1], b[1], strict=True))
    )


FEW_POINTS = 10
"""Up to this many logged losses, each point is marked large and the loss axis starts at 0, so
one noisy log window does not read as divergence."""


def _draw_curves(
    curves: Any, rows: list[dict[str, Any]]
) -> tuple[dict[str, tuple[list[int], list[float]]], list[str]]:
    """The loss curves, each with its own line style and marker; a curve equal to an earlier
    one says so in the legend (it is drawn on top of it). Returns the curves and the labels."""
    from matplotlib.ticker import MaxNLocator

    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D", "v", "P")
    drawn: dict[str, tuple[list[int], list[float]]] = {}
    labels = []
    most = max((len(row.get("loss_history") or []) for row in rows), default=0)
    for index, row in enumerate(rows):
        history = row.get("loss_history") or []
        points = ([p["step"] for p in history], [p["loss"] for p in history])
        same = next((label for label, seen in drawn.items() if _coincide(seen, points)), None)
        label = row["label"]
        if same:
            exact = drawn[same] == points
            label += f" (same losses as {same})" if exact else f" (losses within 0.1% of {same})"
        curves.plot(
            *points,
            linestyle=styles[index % len(styles)],
            marker=markers[index % len(markers)],
            markersize=7 if most <= FEW_POINTS else 3,
            fillstyle="none" if same else "full",  # the earlier curve shows through
            label=label,
        )
        drawn[row["label"]] = points
        labels.append(label)
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))
    if most <= FEW_POINTS:
        highest = max((max(losses, default=0.0) for _, losses in drawn.values()), default=0.0)
        curves.set_ylim(0, highest * 1.1 if highest > 0 else 1)
    curves.set_xlabel("optimizer step")
    curves.set_ylabel("training loss (mean since the previous log line)")
    few = f" ({most} logged points)" if most <= FEW_POINTS else ""
    curves.set_title(f"Training loss{few}")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=9)
    return drawn, labels
