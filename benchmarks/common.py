"""What every benchmark shares: where and when a run happened (provenance), its results file,
running effitrain configurations through ``effitrain.comparison``, and the Markdown tables of its
README, rendered from the results file alone.

A topic is a folder ``benchmarks/<topic>/`` with ``run.py`` (``python -m benchmarks.<topic>.run``),
``results.json`` and ``README.md``. ``results.json`` holds runs::

    {"topic": "levers",
     "runs": [{"name": "cpu", "title": "...", "provenance": {...}, "settings": {...},
               "rows": [...], "notes": ["..."]}]}

A run's ``name`` is its identity: a new run with the same name replaces the old one (git keeps
the history). In ``rows``, a number was measured by the script and is formatted by the topic's
renderer; a string is a cell kept exactly as it was published (runs transcribed from an earlier
README, whose ``provenance.source`` says where from) and is shown verbatim, never recomputed.

A README holds hand-written text around one generated block, between :data:`BEGIN` and
:data:`END`; ``run.py --render`` rewrites that block and ``run.py --check`` fails when it is
stale, so a table is never edited by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effitrain.comparison import Comparison, Configuration

REPO = Path(__file__).resolve().parent.parent
BEGIN = (
    "<!-- results: rendered by `python -m benchmarks.{topic}.run --render` from results.json -->"
)
END = "<!-- /results -->"
VERSIONED = ("torch", "transformers", "accelerate", "datasets", "bitsandbytes", "torchao", "peft")
"""Packages whose versions a measured run records (those installed)."""
Row = dict[str, Any]
Run = dict[str, Any]


@dataclass(frozen=True)
class Topic:
    """One benchmark folder."""

    name: str

    @classmethod
    def of(cls, module_file: str) -> Topic:
        """The topic of a ``benchmarks/<topic>/run.py`` (pass its ``__file__``)."""
        return cls(Path(module_file).resolve().parent.name)

    @property
    def folder(self) -> Path:
        return REPO / "benchmarks" / self.name

    @property
    def results(self) -> Path:
        return self.folder / "results.json"

    @property
    def readme(self) -> Path:
        return self.folder / "README.md"

    @property
    def module(self) -> str:
        return f"benchmarks.{self.name}.run"


# --------------------------------------------------------------------------------------------
# Where, when, what: provenance
# --------------------------------------------------------------------------------------------


def resolve_device(choice: str) -> str:
    """``auto`` -> ``cuda`` where torch sees a GPU, else ``cpu``; ``cuda`` without one is an
    error. torch is imported only where a GPU may be there."""
    if choice == "cpu":
        return "cpu"
    maybe = shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    available = False
    if maybe:
        import torch

        available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise SystemExit("error: --device cuda: torch sees no GPU here")
    return "cuda" if available else "cpu"


def device_env(device: str) -> dict[str, str]:
    """The environment a child needs to train on ``device``: on ``cpu`` it sees no GPU."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def describe_device(device: str) -> dict[str, Any]:
    """The hardware a run used: CPU model and the cores this process may use, or the GPU."""
    if device == "cuda":
        import torch

        return {
            "kind": "cuda",
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "cpu", "name": _cpu_model(), "cores": cores}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages that shape the numbers."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def git_commit() -> str | None:
    """The effitrain commit measured, with ``+changes`` when effitrain/ or a benchmark's code
    differs from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "effitrain", "benchmarks/*.py"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def provenance(topic: Topic, argv: Sequence[str], device: str) -> dict[str, Any]:
    """What ran (the command, with the thread count where it was set; effitrain's commit), where
    (device, versions) and when."""
    threads = os.environ.get("OMP_NUM_THREADS")
    return {
        "source": "measured",
        "command": shlex.join(
            [
                *([f"OMP_NUM_THREADS={threads}"] if threads else []),
                "python",
                "-m",
                topic.module,
                *argv,
            ]
        ),
        "effitrain_commit": git_commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": describe_device(device),
        "versions": versions(),
    }


# --------------------------------------------------------------------------------------------
# Results files
# --------------------------------------------------------------------------------------------


def load_results(path: Path, topic: Topic) -> dict[str, Any]:
    """A results file, or an empty one for ``topic``."""
    if not path.exists():
        return {"topic": topic.name, "runs": []}
    return json.loads(path.read_text())


def rows_not_measured(
    path: Path, topic: Topic, name: str, rows: list[Row], key: Callable[[Row], Any]
) -> tuple[Run | None, list[Row]]:
    """For ``--keep-rows``: the recorded run ``name`` in ``path`` (None: none), and its rows
    whose ``key`` none of ``rows`` has (the ones a run that measures only some keeps)."""
    old = next((r for r in load_results(path, topic)["runs"] if r["name"] == name), None)
    if old is None:
        return None, []
    measured = {key(row) for row in rows}
    return old, [row for row in old["rows"] if key(row) not in measured]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds a lock on ``path``'s folder (no lock file left behind): two benchmarks that record
    into one results file at once (benchmarks/gpu.py runs them side by side) read, write and
    render it in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def record(path: Path, topic: Topic, run: Run) -> dict[str, Any]:
    """Put ``run`` into the results file, replacing a run of the same name; returns the data."""
    data = load_results(path, topic)
    runs = data["runs"]
    names = [old["name"] for old in runs]
    if run["name"] in names:
        runs[names.index(run["name"])] = run
    else:
        runs.append(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One table column: its header, and the text of a row's cell."""

    header: str
    cell: Callable[[Row], str]
    right: bool = True


def markdown_table(columns: Sequence[Column], rows: Iterable[Row], drop_empty: bool = False) -> str:
    """A Markdown table (pipes in cells escaped); with ``drop_empty``, without the columns that
    have nothing in any row (a published table may have fewer columns than a measured one)."""
    rows = list(rows)
    cells = [[str(c.cell(row)).replace("|", "\\|") for c in columns] for row in rows]
    keep = [
        i
        for i in range(len(columns))
        if not drop_empty or any(line[i] not in ("", "–") for line in cells)
    ]
    lines = [
        "| " + " | ".join(columns[i].header for i in keep) + " |",
        "|" + "|".join("---:" if columns[i].right else "---" for i in keep) + "|",
    ]
    lines += ["| " + " | ".join(line[i] for i in keep) + " |" for line in cells]
    return "\n".join(lines)


def shown(value: Any, fmt: Callable[[Any], str]) -> str:
    """A cell: a published string as it is, a missing value as '–', a measured one formatted."""
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return fmt(value)


def derived(row: Row, key: str, compute: Callable[[Row], Any], fmt: Callable[[Any], str]) -> str:
    """A value computed from a measured row, or the published cell ``row[key]``; '–' where the
    row has neither."""
    if isinstance(row.get(key), str):
        return row[key]
    try:
        return fmt(compute(row))
    except (KeyError, TypeError, ZeroDivisionError):
        return "–"


def lr_text(value: float) -> str:
    """An lr as people write it: ``2e-4``, ``0.003``."""
    return f"{value:g}".replace("e-0", "e-")


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def size(value: float) -> str:
    """Bytes in binary units, as effitrain prints them (``502.0 MiB``, ``1.2 GiB``)."""
    from effitrain.memory.ledger import format_bytes

    return format_bytes(int(value))


def ratio(value: Any, reference: Any) -> str:
    """`` (0.52×)`` for two measured numbers; nothing where either is missing or published."""
    if not isinstance(value, int | float) or not isinstance(reference, int | float):
        return ""
    return f" ({value / reference:.2f}×)" if reference else ""


def estimate_error(row: Row, missing: str = "—") -> str:
    """The estimate's signed error against the measured peak tensor memory of a row that has
    both (``estimate_peak_tensor_bytes``, ``peak_tensor_bytes``): ``+2.4%``; ``missing`` else."""
    measured, predicted = row.get("peak_tensor_bytes"), row.get("estimate_peak_tensor_bytes")
    if not measured or predicted is None:
        return missing
    return f"{(predicted - measured) / measured:+.1%}"


def with_ratio(row: Row, base: Row, key: str, fmt: Callable[[Any], str]) -> str:
    """A measured cell with its ratio to the base row's (``1.2 MiB (0.50×)``)."""
    value = row.get(key)
    return shown(value, fmt) + ("" if row is base else ratio(value, base.get(key)))


def seconds_column(base: Row) -> Column:
    """Median seconds per step, with its ratio to the base row's."""
    return Column("s/step", lambda row: with_ratio(row, base, "seconds_per_step", seconds))


def add_rows_argument(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """``--rows NAME ...``: which of a topic's rows to run (default: all)."""
    parser.add_argument(
        "--rows", nargs="+", default=list(names), choices=list(names), metavar="ROW",
        help=f"which rows (default: all): {', '.join(names)}",
    )  # fmt: skip


def seconds(value: float) -> str:
    return f"{value:.2f}"


def describe(run: Run) -> str:
    """The lines above a run's table: what ran, where and when (and where a published run was
    transcribed from)."""
    p = run["provenance"]
    commit = p.get("effitrain_commit")
    what = f"`{p['command']}`" if p.get("command") else "not recorded"
    what += f" at effitrain commit `{commit}`" if commit else " (effitrain commit not recorded)"
    lines = [f"- **What ran:** {what}", f"- **Where:** {_where(p)}", f"- **When:** {p['date']}"]
    if p.get("source", "measured") != "measured":
        lines.append(f"- **Source:** {p['source']}")
    return "\n".join(lines)


def _where(p: dict[str, Any]) -> str:
    device = p.get("device") or {}
    details = []
    if device.get("kind") == "cuda":
        where = f"GPU: {device.get('name', '?')}"
        details += [f"CUDA {device['cuda']}"] if device.get("cuda") else []
    else:
        where = f"CPU: {device.get('name') or 'model not recorded'}"
        cores = device.get("cores")
        where += f", {cores} core{'s' if cores != 1 else ''}" if cores else ""
    details += [device["note"]] if device.get("note") else []
    where += f" ({'; '.join(details)})" if details else ""
    found = p.get("versions") or {}
    if found:
        where += "; " + ", ".join(f"{name} {version}" for name, version in found.items())
    return where


def render_block(topic: Topic, data: dict[str, Any], render_run: Callable[[Run], str]) -> str:
    """The README's generated block: each run's heading, provenance, table(s) and notes."""
    parts = [BEGIN.format(topic=topic.name)]
    for run in data["runs"]:
        parts.append(f"### {run['title']}\n\n{describe(run)}\n\n{render_run(run).strip()}")
        if run.get("notes"):
            parts.append("\n".join(f"- {note}" for note in run["notes"]))
    if not data["runs"]:
        parts.append("No runs recorded yet: this topic needs a GPU (`python -m benchmarks.gpu`).")
    parts.append(END)
    return "\n\n".join(parts)


def replace_block(readme: str, block: str) -> str:
    """``readme`` with its generated block replaced (appended where there is none)."""
    start = readme.find("<!-- results:")
    stop = readme.find(END)
    if start < 0 or stop < start:
        return readme.rstrip("\n") + "\n\n" + block + "\n"
    return readme[:start] + block + readme[stop + len(END) :]


def render_readme(topic: Topic, render_run: Callable[[Run], str], check: bool = False) -> int:
    """Rewrite the README's block from ``results.json``; with ``check``, only say whether it is
    up to date. Returns an exit code."""
    block = render_block(topic, load_results(topic.results, topic), render_run)
    old = topic.readme.read_text() if topic.readme.exists() else f"# {topic.name}\n"
    new = replace_block(old, block)
    if check:
        if new != old:
            print(f"{topic.readme} is stale: python -m {topic.module} --render", file=sys.stderr)
            return 1
        return 0
    topic.readme.write_text(new)
    print(f"rendered {topic.readme.relative_to(REPO)}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# The command line every run.py shares
# --------------------------------------------------------------------------------------------


def parser(topic: Topic, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has; the topic adds its own."""
    summary, _, rest = (doc or "").strip().partition("\n\n")
    result = argparse.ArgumentParser(
        prog=f"python -m {topic.module}",
        description=summary,
        epilog=rest or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = result.add_argument_group("results")
    group.add_argument(
        "--render", action="store_true", help="only rewrite README.md's tables from results.json"
    )
    group.add_argument(
        "--check", action="store_true", help="only check that README.md matches results.json"
    )
    group.add_argument(
        "--results",
        type=Path,
        default=topic.results,
        help="where the run is recorded (default: the committed results.json, and the README "
        "is rendered again; give a scratch path for trial runs)",
    )
    group.add_argument("--name", help="the run's name in the results file (same name: replaced)")
    group.add_argument(
        "--work-dir",
        type=Path,
        default=REPO / ".bench" / topic.name,
        help="each run's metrics and output (default: .bench/<topic>, ignored by git)",
    )
    group.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the runs train (auto: the GPU where torch sees one)",
    )
    return result


def main(
    topic: Topic,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    measure: Callable[[argparse.Namespace, str], Run],
    render_run: Callable[[Run], str],
) -> int:
    """Render or check the README, or measure a run, record it and show it. ``measure`` gets the
    options and the resolved device and returns the run without its provenance."""
    if args.render or args.check:
        return render_readme(topic, render_run, check=args.check)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    device = resolve_device(args.device)
    run = measure(args, device)
    run["provenance"] = provenance(topic, sys.argv[1:] if argv is None else argv, device)
    failed = run.pop("failed", False)
    with locked(args.results):
        record(args.results, topic, run)
        print(f"### {run['title']}\n\n{describe(run)}\n\n{render_run(run)}")
        for note in run.get("notes", []):
            print(f"- {note}")
        if args.results.resolve() == topic.results.resolve():
            render_readme(topic, render_run)
        else:
            print(f"recorded in {args.results} (a scratch file: README.md is not changed)")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# Running configurations through effitrain.comparison
# --------------------------------------------------------------------------------------------


def run_configurations(
    rows: list[Configuration],
    common: list[str],
    work_dir: Path,
    repeats: int = 1,
    **options: Any,
) -> Comparison:
    """``effitrain.comparison.compare`` with progress on stderr and each run's files under
    ``work_dir`` (a fresh process per run, repeats in turn, medians)."""
    from effitrain.comparison import compare

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if work_dir.exists():
        shutil.rmtree(work_dir / "runs", ignore_errors=True)
    comparison = compare(rows, common, work_dir, repeats, progress=progress, **options)
    for label, error in comparison.failed.items():
        print(f"failed: {label}: {error} (its output: {work_dir / 'runs'})", file=sys.stderr)
    return comparison


def where(device: str) -> str:
    return "GPU" if device == "cuda" else "CPU"


def new_run(
    args: argparse.Namespace,
    device: str,
    title: str,
    settings: dict[str, Any],
    comparison: Comparison,
) -> Run:
    """A run from a comparison: its rows, and each failed configuration as a note (the run then
    exits non-zero); named by ``--name``, else ``gpu`` or ``cpu``."""
    if not comparison.rows:
        raise SystemExit("error: no configuration ran")
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": f"{title}, {where(device)}",
        "settings": settings,
        "rows": comparison.rows,
        "notes": [f"{label} failed: {error}" for label, error in comparison.failed.items()],
        "failed": bool(comparison.failed),
    }


def median(runs: Sequence[dict[str, Any]], key: str) -> Any:
    """The median of ``key`` over runs; None where a run lacks it."""
    values = [run.get(key) for run in runs]
    return None if any(v is None for v in values) else statistics.median(values)


def process_peak(runs: Sequence[dict[str, Any]]) -> Any:
    """The median over runs of each process's peak RSS, as the kernel counted it."""
    return median([run["process"] for run in runs], "peak_rss_bytes")


def write_long_texts(folder: Path, rows: int, validation_rows: int = 16) -> tuple[Path, Path]:
    """train.csv and validation.csv of 200-word texts (so every example fills 128 tokens) with
    two labels: synthetic, deterministic, for memory and time (nothing here is learnable)."""
    rng = random.Random(0)
    words = ["the", "committee", "approved", "budget", "report", "was", "board", "rejected",
             "plan", "a", "new"]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n in (("train", rows), ("validation", validation_rows)):
        path = folder / f"{name}.csv"
        lines = ["text,label"]
        lines += [f"{' '.join(rng.choices(words, k=200))},{rng.randint(0, 1)}" for _ in range(n)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths[0], paths[1]
