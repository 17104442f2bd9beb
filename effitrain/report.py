"""Everything effitrain prints: run banner, progress, eval lines, the memory tables, JSON.

Printing never computes: training hands over the plain records of :mod:`effitrain.results`.
The CLI makes the one :class:`Reporter` of a run; training sets ``enabled`` to whether this is
the main process, so that everything is printed once under ``accelerate launch``.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.memory.ledger import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from effitrain.memory.ledger import OptimizerStateLedger
    from effitrain.results import (
        Estimate,
        HostMemory,
        MemoryRecord,
        PlanResult,
        RunInfo,
        StateReport,
        StepLog,
        TrainResult,
    )


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


class Reporter:
    """Prints a run's progress and results on the main process.

    Args:
        enabled: False on every process but the main one: nothing is printed. ``train()``
            sets it once the Accelerator knows which process this is.
        quiet: only the final results are printed.
        console: a rich Console (default: stdout). When it is not a terminal, the progress bar
            is replaced by plain log lines every ``log_every`` steps, so CI logs stay readable.
    """

    def __init__(self, enabled: bool = True, quiet: bool = False, console: Console | None = None):
        from rich.console import Console

        self.enabled = enabled
        self.quiet = quiet
        self.console = console or Console(highlight=False)
        self._progress: Any = None
        self._task: Any = None
        self._speed_unit = "samples"
        """What throughput counts: the task's (set by run_started)."""
        self._epochs = 1
        """How many epochs the run has (set by run_started): a log line names the epoch only
        when there are several."""

    def _line(self, text: str) -> None:
        # soft_wrap: never insert hard line breaks (log files and narrow terminals stay greppable).
        self.console.print(text, soft_wrap=True)

    @property
    def _chatty(self) -> bool:
        return self.enabled and not self.quiet

    def note(self, message: str) -> None:
        """A warning or hint the user should see even with --quiet."""
        if self.enabled:
            from rich.markup import escape

            # escaped: a hint such as pip install 'effitrain[lora]' is text, not markup
            self._line(f"[yellow]note:[/] {escape(message)}")

    def run_started(self, info: RunInfo) -> None:
        self._speed_unit = info.speed_unit
        self._epochs = info.epochs
        if not self._chatty:
            return
        trainable = info.trainable_parameters
        frozen = f", {_count(trainable)} trainable" if trainable < info.parameters else ""
        self._line(
            f"[bold]effitrain[/] · model [cyan]{info.model}[/] ({info.model_class}, "
            f"{_count(info.parameters)} params{frozen})"
        )
        self._line(
            f"  data      {info.dataset}: {info.train_examples:,} train / "
            f"{info.validation_examples:,} validation ({info.validation_source}); {info.data_line}"
        )
        lr_note = f" ({info.lr_note})" if info.lr_note else ""
        self._line(
            f"  optimizer [cyan]{info.optimizer}[/] ({info.optimizer_class}), "
            f"lr {info.lr:g}{lr_note}"
        )
        if info.optimizer_split:
            self._line(f"  split     {info.optimizer_split}")
        schedule_note = f" ({info.schedule_note})" if info.schedule_note else ""
        self._line(
            f"  schedule  {info.total_steps} steps ({info.epochs} epoch(s) × "
            f"{info.steps_per_epoch} steps), {info.warmup_steps} warmup then {info.scheduler}"
            f"{schedule_note}, global batch {info.global_batch_size}"
        )
        # Said here, once: the closing lines then leave the MFU out.
        peak = f"; no MFU: the peak FLOP/s of {info.peak_unknown} is unknown"
        self._line(
            f"  device    {info.device} × {info.num_processes} process(es), "
            f"mixed precision {info.mixed_precision}{peak if info.peak_unknown else ''}"
        )
        for lever in info.levers:
            self._line(f"  lever     {lever}")

    def progress_started(self, total_steps: int, completed: int = 0) -> None:
        if not self._chatty or not self.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=completed, stats=""
        )
        self._progress.start()

    def step_done(self, step: int) -> None:
        """Advance the bar (cheap; called once per optimizer step)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def logged(self, log: StepLog) -> None:
        if not self._chatty:
            return
        # A log line stays within 100 characters for most runs, so a terminal does not wrap
        # it: "tok/s" (the closing lines spell it out), the epoch only where there are several.
        tokens = "tokens/s" if self._progress is not None else "tok/s"
        speed = _speed(log, self._speed_unit, tokens)
        stats = f"loss {log.loss:.4f}{_rewards_text(log.metrics)} · lr {log.lr:.2e} · {speed}"
        if self._progress is not None:
            self._progress.update(self._task, completed=log.step, stats=stats)
        else:
            epoch = f" · epoch {log.epoch}" if self._epochs > 1 else ""
            self._line(
                f"step {log.step}/{log.total_steps}{epoch} · {stats} · "
                f"eta {_duration(log.eta_seconds)}"
            )

    def evaluated(self, epoch: int, metrics: dict[str, float], final: bool = False) -> None:
        if not self._chatty:
            return
        where = "end" if final else f"epoch {epoch}"
        self._line(f"eval ({where}) · {_eval_text(metrics, loss_first=True)}")
        if "sample" in metrics:
            from rich.markup import escape

            self._line(f"  sample    {escape(repr(metrics['sample']))}")

    def progress_finished(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def finished(self, result: TrainResult) -> None:
        """The closing summary and the optimizer-memory tables (printed even with --quiet)."""
        if not self.enabled:
            return
        self.progress_finished()
        c = self.console
        ev = result.eval
        speed = _speed(result, result.speed_unit)
        self._line(
            f"[bold green]done[/] · {result.global_steps} steps in {result.train_seconds:.1f} s · "
            f"train loss {result.train_loss:.4f} · eval {_eval_text(ev)}"
        )
        self._line(
            f"  speed     {result.seconds_per_step * 1000:.1f} ms/step · {speed}{_work_text(result)}"
        )
        c.print(optimizer_state_table(result))
        c.print(memory_table(result.memory, result.optimizer, result))
        if len(result.ranks) > 1 or result.sharding.get("kind", "single") != "single":
            c.print(ranks_table(result))

    def status(self, message: str) -> None:
        """What the run is doing before its first step (not with --quiet)."""
        if self._chatty:
            self._line(message)

    def saved_metrics(self, path: str) -> None:
        if self._chatty:
            self._line(f"metrics written to {path}")

    def resumed(self, path: str, global_step: int, epoch: int, step_in_epoch: int) -> None:
        """Where a resumed run continues (printed even with --quiet)."""
        if self.enabled:
            self._line(
                f"resumed from {path} · step {global_step} · epoch {epoch + 1}, "
                f"{step_in_epoch} step(s) into it"
            )

    def checkpoint_saved(self, path: str, step: int) -> None:
        if self._chatty:
            self._line(f"checkpoint saved: {path} (step {step})")

    def saved_final(self, path: str) -> None:
        if self._chatty:
            self._line(f"model and tokenizer saved to {path} (save_pretrained, safetensors)")

    def not_saved(self) -> None:
        if self._chatty:
            self._line(
                "the trained model is not saved (no --output-dir); add --output-dir DIR to keep it"
            )

    def stopped_at_once(self, signal_name: str, when: str) -> None:
        """A signal stopped the run outside the loop, ``when`` (even with --quiet)."""
        if self.enabled:
            self.progress_finished()
            self._line(f"[yellow]stopped[/] by {signal_name} {when}")

    def stopped(
        self, signal_name: str, step: int, checkpoint: Path | None, resume_command: str | None
    ) -> None:
        """A signal stopped the run: what was kept and how to continue (even with --quiet)."""
        if not self.enabled:
            return
        self.progress_finished()
        if checkpoint is None:
            self._line(
                f"[yellow]stopped[/] by {signal_name} after step {step}; nothing was saved "
                "(add --output-dir DIR to keep a checkpoint)"
            )
            return
        self._line(
            f"[yellow]stopped[/] by {signal_name} after step {step}; checkpoint: {checkpoint}"
        )
        self._line(f"resume with: {resume_command}")


def optimizer_state_table(result: TrainResult) -> Any:
    """Per state key: tensors, elements, bytes, dtypes; then the total."""
    return ledger_table(
        result.memory.optimizer_state,
        f"Optimizer state: {result.optimizer} ({result.optimizer_class})",
    )


def ledger_table(ledger: OptimizerStateLedger, title: str) -> Any:
    """A measured optimizer-state ledger as a table: one row per state key, then the total."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("state key")
    table.add_column("tensors", justify="right")
    table.add_column("elements", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("dtypes")
    for key, usage in ledger.by_key.items():
        table.add_row(
            key,
            f"{usage.tensors:,}",
            f"{usage.elements:,}",
            format_bytes(usage.bytes),
            ", ".join(usage.dtypes),
        )
    table.add_section()
    table.add_row(
        "[bold]total[/]",
        f"{ledger.tensors:,}",
        f"{ledger.elements:,}",
        f"[bold]{format_bytes(ledger.bytes)}[/]",
        f"{ledger.params_with_state} params with state",
    )
    return table


def memory_table(memory: MemoryRecord, optimizer: str, run: TrainResult | None = None) -> Any:
    """The memory breakdown of this process. Per part: its own peak in one optimizer step, its
    share of the step's peak tensor memory, and what the same model would hold trained whole in
    fp32 with fp32 AdamW and no levers; the levers' own rows (host memory apart). Then the
    peaks (``run``: a run's whole-process peak)."""
    from rich.table import Table

    step = memory.step_memory
    at_peak = step.at_peak if step else {}
    kind_peaks = step.kind_peaks if step else {}
    base = memory.baseline
    table = Table(title=f"Memory ({', '.join(memory.levers) or 'no levers'})", title_justify="left")
    table.add_column("what")
    table.add_column("measured", justify="right")
    table.add_column("at peak", justify="right")
    table.add_column("fp32 AdamW, no levers", justify="right")
    rows = [
        ("parameters", memory.parameter_bytes, "parameters", base.parameter_bytes),
        ("gradients", memory.gradient_bytes, "gradients", base.gradient_bytes),
        (
            f"optimizer state ({optimizer})",
            memory.optimizer_state.bytes,
            "optimizer_state",
            base.optimizer_state_bytes,
        ),
        ("activations", memory.activation_bytes, "activations", None),
        ("backward temporaries", kind_peaks.get("temporaries"), "temporaries", None),
        (
            "optimizer step temporaries",
            kind_peaks.get("optimizer_temporaries"),
            "optimizer_temporaries",
            None,
        ),
    ]
    for label, measured, kind, baseline in rows:
        if measured is None and not at_peak:
            continue
        table.add_row(
            label,
            format_bytes(measured) if measured is not None else "—",
            format_bytes(at_peak[kind]) if kind in at_peak else "—",
            _versus(measured, baseline) if baseline is not None else "—",
        )
        for row in memory.lever_rows:
            if row.part_of == kind:
                at = format_bytes(row.at_peak) if row.at_peak is not None else ""
                table.add_row(row.label, format_bytes(row.measured), at, "")
    other = at_peak.get("buffers", 0) + at_peak.get("other", 0)
    if other:
        table.add_row("buffers, other", "", format_bytes(other), "")
    host = [row for row in memory.lever_rows if row.part_of is None]
    if host:
        table.add_section()
    for row in host:  # the offload levers' host memory: not in the device's peak
        table.add_row(row.label, format_bytes(row.measured), "—", "—")
    table.add_section()
    if memory.peak_tensor_bytes is not None:
        table.add_row(
            "[bold]peak tensor memory[/]",
            "",
            f"[bold]{format_bytes(memory.peak_tensor_bytes)}[/]",
            "—",
        )
    if step and step.cuda_max_allocated:
        table.add_row("tracked tensors", "", format_bytes(sum(at_peak.values())), "")
    if run is not None:
        peak_label = {"cuda_peak_allocated": "CUDA peak (run)", "peak_rss": "peak RSS"}.get(
            run.peak_memory_kind, run.peak_memory_kind
        )
        table.add_row(peak_label, format_bytes(run.peak_memory_bytes), "", "")
    table.caption = _memory_caption(memory)
    table.caption_justify = "left"
    return table


def _memory_caption(memory: MemoryRecord) -> str:
    frozen = memory.parameter_bytes - memory.trainable_parameter_bytes
    lines = [f"{memory.trainable_parameters:,} trainable parameters"]
    if frozen > 0:
        lines[0] += (
            f" ({format_bytes(memory.trainable_parameter_bytes)}); frozen {format_bytes(frozen)}"
        )
    adamw = memory.adamw_equivalent_bytes
    if adamw:
        lines.append(
            f"optimizer state: {memory.optimizer_state.bytes / adamw:.1%} of fp32 AdamW's "
            f"{format_bytes(adamw)} on the same parameters"
        )
    if memory.step_memory:
        lines.append(
            "measured: each part's own peak in one optimizer step; at peak: the parts when that "
            "step's live tensors peaked (they add up to it; on CUDA the peak is "
            "max_memory_allocated, beside what the tracker saw)"
        )
    else:
        lines.append(
            "activations and peak tensor memory not measured (--no-memory-breakdown, a run "
            "stopped before its last steps, torch < 2.5, or a step torch.compile runs: torchao's "
            "optimizers compile theirs)"
        )
    return "\n".join(lines)


def _versus(value: int, baseline: int | None) -> str:
    """The baseline and the saving against it: ``502.0 MiB (−75%)``."""
    if not baseline:
        return "—"
    change = value / baseline - 1
    if abs(change) < 0.0005:
        return format_bytes(baseline)
    return f"{format_bytes(baseline)} ({change:+.0%})".replace("-", "−")


def ranks_table(result: TrainResult) -> Any:
    """Per process: how it got the model's weights, optimizer state, parameters, peak memory;
    then the total over processes.

    The title names the sharding in use (DDP replicates, FSDP/ZeRO shard: the totals say what
    the whole job holds).
    """
    from rich.table import Table

    description = result.sharding.get("description", f"{result.num_processes} processes")
    table = Table(title=f"Per rank: {description}", title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("device")
    table.add_column("weights")
    table.add_column("optimizer state", justify="right")
    table.add_column("parameters", justify="right")
    table.add_column("peak memory", justify="right")
    for entry in result.ranks:
        table.add_row(
            str(entry["rank"]),
            entry["device"],
            entry.get("weights", "read"),
            format_bytes(entry["optimizer_state_bytes"]),
            format_bytes(entry["parameter_bytes"]),
            format_bytes(entry["peak_memory_bytes"]),
        )
    totals = result.ranks_total
    if totals:
        table.add_section()
        table.add_row(
            "[bold]total[/]",
            "",
            "",
            f"[bold]{format_bytes(totals['optimizer_state_bytes'])}[/]",
            format_bytes(totals["parameter_bytes"]),
            format_bytes(totals["peak_memory_bytes"]),
        )
    return table


def write_metrics_json(path: str | Path, metrics: dict[str, Any]) -> None:
    """Write the run's metrics as one JSON object (atomically: no half-written file)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        raise EffitrainError(f"cannot write --metrics-json {path}: {exc.strerror}") from exc


# --------------------------------------------------------------------------------------------
# effitrain inspect-state
# --------------------------------------------------------------------------------------------


def _hyperparameters(group: dict[str, Any]) -> str:
    shown = {k: v for k, v in group.items() if k != "params" and v is not None and v is not False}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def print_state_report(report: StateReport, top: int, console: Console | None = None) -> None:
    """``effitrain inspect-state``: summary, per-key table, largest states, AdamW comparison."""
    from rich.console import Console

    console = console or Console(highlight=False)

    def line(text: str) -> None:
        console.print(text, soft_wrap=True)

    name = (
        f"{report.optimizer_name} ({report.optimizer_class})"
        if report.optimizer_name
        else (
            f"{report.optimizer_class} (inferred from the state keys)"
            if report.optimizer_inferred
            else report.optimizer_class
        )
    )
    line(f"[bold]{report.path}[/] · {report.format}")
    for file in report.files:
        line(f"  file       {file}")
    line(f"  optimizer  [cyan]{name}[/]")
    line(f"  state for  {report.ledger.params_with_state:,} parameters")
    line(f"  step       {report.step if report.step is not None else 'unknown'}")
    for index, group in enumerate(report.param_groups):
        line(f"  group {index}    {group.get('params', '?')} params · {_hyperparameters(group)}")
    console.print(ledger_table(report.ledger, "Optimizer state by key"))

    console.print(largest_states_table(report.params[:top], top, console.width))

    adamw = report.adamw_equivalent_bytes
    state = report.ledger.bytes
    ratio = f"{state / adamw:.1%} of AdamW" if adamw else "no AdamW reference"
    line(
        f"total [bold]{format_bytes(state)}[/] ({ratio}) · AdamW (fp32) would keep "
        f"{format_bytes(adamw)} for the same {len(report.params) - report.params_without_shape:,} "
        "parameters (shapes inferred from the state)"
    )
    if report.params_without_shape:
        line(
            f"[yellow]note:[/] {report.params_without_shape} parameter(s) with state of unknown "
            "shape are left out of the AdamW figure"
        )


def largest_states_table(params: list[Any], top: int, width: int) -> Any:
    """The largest per-parameter states, their names told apart within ``width`` columns: the
    dotted prefix they all share is said once in the title, a column whose value is the same on
    every row is said once in the caption, and a name still too long keeps its end."""
    from rich.table import Table

    columns = {
        "parameter": [row.parameter for row in params],
        "shape": [
            "×".join(map(str, row.shape)) if row.shape is not None else "?" for row in params
        ],
        "state keys": [", ".join(row.keys) for row in params],
        "bytes": [format_bytes(row.bytes) for row in params],
        "second moment": [row.second_moment for row in params],
    }
    same = [
        name
        for name in ("state keys", "second moment")
        if len(params) > 1 and len(set(columns[name])) == 1
    ]
    prefix = _common_prefix(columns["parameter"]) if len(params) > 1 else ""
    names = [name.removeprefix(prefix) for name in columns["parameter"]]
    shown = [name for name in columns if name not in same]
    # Each column's padding and border take 3 columns, the table's left edge 1.
    room = (
        width
        - 1
        - sum(3 + max(len(name), *map(len, columns[name])) for name in shown if name != "parameter")
    )
    room = max(room - 3, len("parameter"))
    table = Table(
        title=f"Largest per-parameter states (top {top})"
        + (f", names under {prefix}" if prefix else ""),
        title_justify="left",
        caption=("every row: " + "; ".join(f"{name} {columns[name][0]}" for name in same))
        if same
        else None,
        caption_justify="left",
    )
    for name in shown:
        table.add_column(name, justify="right" if name == "bytes" else "left")
    for index, name in enumerate(names):
        cells = {"parameter": _tail(name, room)}
        table.add_row(*(cells.get(column) or columns[column][index] for column in shown))
    return table


def _common_prefix(names: list[str]) -> str:
    """The dotted prefix every name shares (``distilbert.``), leaving each its last part."""
    common = []
    for parts in zip(*(name.split(".")[:-1] for name in names), strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "".join(f"{part}." for part in common)


def _tail(name: str, width: int) -> str:
    """``…layer.1.attention.q_lin.weight``: the longest end of ``name`` after a dot that fits
    ``width`` with its ``…`` (the end tells the rows apart), else its last characters."""
    if len(name) <= width:
        return name
    for index, char in enumerate(name):
        if char == "." and len(name) - index <= width:
            return "…" + name[index + 1 :]
    return "…" + name[-(width - 1) :]


# --------------------------------------------------------------------------------------------
# effitrain estimate
# --------------------------------------------------------------------------------------------

ESTIMATE_FIELDS = (
    ("parameters", "parameter_bytes"),
    ("  trained", "trainable_parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state.bytes"),
    ("activations", "activation_bytes"),
    ("peak tensor memory", "peak_tensor_bytes"),
)
"""The parts an estimate gives: a label and the metrics JSON's field (dotted: nested)."""

PER_DEVICE_FIELDS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("peak tensor memory", "peak_tensor_bytes"),
)


def metrics_field(data: dict[str, Any], key: str) -> Any:
    """A metrics JSON field by its dotted name (None where it is missing)."""
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None  # type: ignore[assignment]
    return data


def print_estimates(
    results: list[Estimate],
    against: dict[str, Any] | None = None,
    skipped: list[str] | None = None,
    console: Console | None = None,
) -> None:
    """``effitrain estimate``: the estimates side by side (one row each when there are many),
    each process's share, the notes; with ``against`` (a measured run's metrics JSON, its
    errors and mismatches), the measured column and the error of the estimate of the same
    optimizer."""
    from rich.console import Console

    console = console or Console(highlight=False)
    if len(results) > 4 and against is None:
        console.print(estimates_by_row(results))
    else:
        console.print(estimates_table(results, against))
    if results[0].per_device is not None:
        console.print(per_device_table(results))
        console.print(
            "Not included: FSDP's all-gathered layer (one layer's full parameters at a time) and "
            "DDP's gradient buckets."
        )
    if results[0].host is not None:
        which = f" ({results[0].optimizer})" if len(results) > 1 else ""
        console.print(host_line(results[0].host, which))
    console.print(
        "Peak tensor memory: the most bytes of live tensors at once in one optimizer step (the "
        "run's memory table); a process holds more (libraries, the CUDA context, allocator "
        "caching). Every example is assumed --max-length tokens long."
    )
    notes = [*dict.fromkeys(n for r in results for n in r.notes)]
    notes += (against or {}).get("mismatches", []) + (skipped or [])
    for note in notes:
        console.print(f"note: {note}", markup=False)


def _estimate_title(first: Estimate) -> str:
    settings = first.settings
    micro = f", {settings.grad_accum} micro-batches" if settings.grad_accum > 1 else ""
    batch = f"{settings.batch_size}"
    if settings.sequences_per_example == 2:
        batch = f"{settings.batch_size} pairs ({2 * settings.batch_size} sequences)"
    return f"Estimate: {settings.model}, batch {batch} x {settings.max_length} tokens{micro}"


def estimates_table(results: list[Estimate], against: dict[str, Any] | None = None) -> Any:
    """One column per estimate; with ``against``, the measured run and the estimate's error.
    The rows are the metrics JSON's fields (the measured run's are read by those names), then
    the levers' rows."""
    from rich.table import Table

    table = Table(title=_estimate_title(results[0]), title_justify="left")
    table.add_column("what")
    for result in results:
        levers = f" + {', '.join(result.memory.levers)}" if result.memory.levers else ""
        table.add_column(result.optimizer + levers, justify="right")
    if against is not None:
        table.add_column("measured", justify="right")
        table.add_column(f"error ({against['optimizer']})", justify="right")
    fields = [result.to_dict() for result in results]
    for label, key in ESTIMATE_FIELDS:
        cells = [format_bytes(metrics_field(f, key) or 0) for f in fields]
        if against is not None:
            truth = metrics_field(against["measured"], key)
            error = against["errors"][key]
            cells += [
                format_bytes(truth) if truth is not None else "-",
                f"{error:+.1%}" if error is not None else "-",
            ]
        table.add_row(label, *cells)
        part = {"trainable_parameter_bytes": "parameters"}.get(key)
        for row_label in _lever_row_labels(results, part) if part else []:
            table.add_row(row_label, *_lever_cells(results, row_label, against))
    for row_label in _lever_row_labels(results, None):  # host memory, not in the device's peak
        table.add_row(f"host: {row_label}", *_lever_cells(results, row_label, against))
    if any(result.host is not None for result in results):
        cells = [format_bytes(r.host.host_peak_bytes) if r.host else "-" for r in results]
        table.add_row("host RAM, one machine", *cells, *(["", ""] if against else []))
    if any(result.cost is not None for result in results):
        cells = [format_flops(r.cost.flops_per_step) if r.cost else "-" for r in results]
        if against is not None:
            truth = against["measured"].get("flops_per_step")
            cells += [format_flops(truth) if truth is not None else "-", ""]
        table.add_row("FLOPs per step", *cells)
    return table


def host_line(host: HostMemory, which: str = "") -> str:
    """How an estimate's host figure is made up, in one sentence (``which``: of which
    estimate)."""
    checkpoint = host.checkpoint
    read = (
        f"the {format_bytes(checkpoint.bytes)} {checkpoint.dtype} checkpoint read as "
        f"{host.read_dtype} onto the {host.read_onto}"
        if checkpoint is not None
        else f"the preset built in {host.read_dtype}"
    )
    parts = [
        (host.mapped_bytes, "pages read"),
        (host.weights_bytes, "weights made"),
        (host.quantize_buffer_bytes, "quantizing"),
    ]
    held = " + ".join(f"{label} {format_bytes(value)}" for value, label in parts if value)
    loading = f"loading {format_bytes(host.load_peak_bytes)}" + (f" ({held})" if held else "")
    loading += f" × {host.copies} processes reading" if host.copies > 1 else ""
    receivers = host.processes - host.copies
    if receivers:
        loading += f", {receivers} receiving the weights ({format_bytes(host.received_bytes)} each)"
    step = f", the step's tensors {format_bytes(host.step_bytes)}" if host.step_bytes else ""
    return (
        f"Host RAM{which} {format_bytes(host.host_peak_bytes)} (one machine, at its peak in "
        f"{host.peak_at}): {read}; {loading}{step}; libraries {format_bytes(host.library_bytes)}"
        f" × {host.processes} process{'es' if host.processes > 1 else ''}."
    )


def _lever_row_labels(results: list[Estimate], part: str | None) -> list[str]:
    labels = (row.label for r in results for row in r.memory.lever_rows if row.part_of == part)
    return list(dict.fromkeys(labels))


def _lever_cells(results: list[Estimate], label: str, against: dict[str, Any] | None) -> list[str]:
    cells = []
    for result in results:
        values = [row.measured for row in result.memory.lever_rows if row.label == label]
        cells.append(format_bytes(values[0]) if values else "-")
    return cells + (["", ""] if against is not None else [])


def estimates_by_row(results: list[Estimate]) -> Any:
    """Many estimates (``--optim all``): one row each, the parts as columns."""
    from rich.table import Table

    short = {"parameters": "params", "gradients": "grads", "optimizer state": "state"}
    short["peak tensor memory"] = "peak"
    columns = [
        (short.get(label, label), key) for label, key in ESTIMATE_FIELDS[:1] + ESTIMATE_FIELDS[2:]
    ]
    columns.append(("host RAM", "host_peak_bytes"))
    table = Table(title=_estimate_title(results[0]), title_justify="left")
    table.add_column("optimizer")
    for label, _ in columns:
        table.add_column(label, justify="right")
    for result in results:
        fields = result.to_dict()
        cells = [metrics_field(fields, k) for _, k in columns]
        table.add_row(result.optimizer, *(format_bytes(c) if c is not None else "-" for c in cells))
    return table


def per_device_table(results: list[Estimate]) -> Any:
    """Each process's share of every estimate (``--num-processes``, ``--sharding``)."""
    from rich.table import Table

    first = results[0].per_device
    assert first is not None
    table = Table(
        title=f"Per process: {first.num_processes} processes, {first.sharding} ({first.modeled})",
        title_justify="left",
    )
    table.add_column("what")
    for result in results:
        table.add_column(result.optimizer, justify="right")
    for label, key in PER_DEVICE_FIELDS:
        table.add_row(
            label,
            *(format_bytes(getattr(r.per_device, key, None) or 0) for r in results),
        )
    return table


# --------------------------------------------------------------------------------------------
# effitrain compare
# --------------------------------------------------------------------------------------------

PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
)
"""The stacked parts of the memory bars (metrics JSON fields; optimizer state flattened)."""

COLUMNS = (
    *PARTS,
    ("peak tensors", "peak_tensor_bytes"),
    ("peak RSS", "peak_memory_bytes"),
    ("s/step", "seconds_per_step"),
    ("FLOPs/step", "flops_per_step"),
    ("TFLOP/s", "achieved_tflops"),
    ("MFU", "mfu"),
    ("final loss", "final_loss"),
    ("eval accuracy", "eval_accuracy"),
    ("eval perplexity", "eval_perplexity"),
    ("eval reward acc", "eval_reward_accuracy"),
)
"""The table's and the CSV's numeric columns."""


def print_comparison(
    rows: list[dict[str, Any]],
    written: dict[str, Path],
    failed: dict[str, str],
    console: Console | None = None,
) -> None:
    """``effitrain compare``'s results: the table (:func:`comparison_table`), the files
    written, and each configuration that failed, with its reason."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(highlight=False)
    console.print(comparison_table(rows))
    console.print("Wrote " + ", ".join(str(path) for path in written.values()), soft_wrap=True)
    if "png" not in written:
        console.print(
            "note: no compare.png: install matplotlib (pip install 'effitrain[plot]')",
            markup=False,
        )
    for label, error in failed.items():
        console.print(f"[red]failed[/]: {escape(label)}: {escape(error)}", soft_wrap=True)


def comparison_table(rows: list[dict[str, Any]]) -> Any:
    """One column per configuration (the usual three fit 80 columns), memory and time also as
    ratios to the first."""
    from rich.table import Table

    base = rows[0]
    table = Table(
        title=f"Compared (ratios to {base['label']}; memory parts: each one's peak in one step)",
        title_justify="left",
    )
    table.add_column("what")
    for row in rows:
        table.add_column(row["label"].replace(" +", "\n+"), justify="right")
    for label, key in COLUMNS:
        if all(row[key] is None for row in rows):
            continue  # eval accuracy for a causal LM, perplexity for a classifier, …
        table.add_row(label, *(_compared_cell(row, base, key) for row in rows))
    return table


def _compared_cell(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    value, reference = row[key], base[key]
    if value is None:
        return "-"
    if key.endswith("bytes"):
        shown = format_bytes(value)
    elif key == "seconds_per_step":
        shown = f"{value:.2f}"
    elif key == "flops_per_step":
        shown = format_flops(value)
    elif key == "mfu":
        shown = f"{value:.1%}"
    else:
        shown = f"{value:.3f}"
    ratio = key.endswith("bytes") or key in ("seconds_per_step", "flops_per_step")
    if row is not base and reference and ratio:
        shown += f" ({value / reference:.2f}×)"
    return shown


def _speed(record: StepLog | TrainResult, unit: str, tokens: str = "tokens/s") -> str:
    """Throughput: ``tokens`` (tokens/s, causal-lm, padding left out) or samples/s."""
    if unit == "tokens":
        return f"{record.tokens_per_second:,.0f} {tokens}"
    return f"{record.samples_per_second:,.0f} samples/s"


def format_flops(flops: float) -> str:
    """FLOPs in the largest unit that keeps a number >= 1 (``313.4 GFLOP``)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops:,.0f} FLOP"


def _work_text(result: TrainResult) -> str:
    """The step's FLOPs, what the device achieved and, where its peak is known, the MFU (the
    banner says once where it is not)."""
    if result.flops_per_step is None:
        return " · FLOPs not counted"  # torchao's compiled step: docs/cost.md
    if result.achieved_tflops is None:
        return ""
    mfu = f" · MFU {result.mfu:.1%}" if result.mfu is not None else ""
    return (
        f" · {format_flops(result.flops_per_step)}/step · "
        f"{format_flops(result.achieved_tflops * 1e12)}/s per device{mfu}"
    )


def _rewards_text(metrics: dict[str, Any]) -> str:
    """A preference loss's reward accuracy and margin (`` · reward acc 0.625 · margin
    +0.041``), or '' for other losses."""
    if "rewards/accuracies" not in metrics:
        return ""
    return (
        f" · reward acc {metrics['rewards/accuracies']:.3f} · "
        f"margin {metrics['rewards/margins']:+.3f}"
    )


def _eval_text(metrics: dict[str, Any], loss_first: bool = False) -> str:
    """An evaluation's numbers: loss and perplexity (causal-lm), loss and reward accuracy
    (preference), or accuracy, F1 and loss."""
    loss = f"loss {metrics['loss']:.4f}"
    if "rewards/accuracies" in metrics:
        return f"{loss}{_rewards_text(metrics)}"
    if "perplexity" in metrics:
        return f"{loss} · perplexity {metrics['perplexity']:.2f}"
    scores = f"accuracy {metrics['accuracy']:.4f} · f1 {metrics['f1']:.4f}"
    return f"{loss} · {scores}" if loss_first else f"{scores} · {loss}"


def print_plan(result: PlanResult, console: Console | None = None) -> None:
    """``effitrain plan``: the budget and margin, then each configuration that fits, best
    first: its peak, FLOPs and relative time, why each lever is in, its command."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(highlight=False)
    margin = (
        "tensor bytes, as train --max-memory measures them on the CPU"
        if result.device_type == "cpu"
        else "the CUDA context, workspaces and the allocator's cache"
    )
    console.print(
        f"Budget {format_bytes(result.budget_bytes)} per device ({result.device_type}), "
        f"margin {format_bytes(result.margin_bytes)} ({margin}); {result.screened} "
        f"configurations screened with {result.estimates} fake-tensor estimates in "
        f"{result.seconds:.0f} s. Fastest first:"
    )
    for rank, candidate in enumerate(result.candidates, start=1):
        peak = format_bytes(candidate.peak_tensor_bytes)
        checked = "verified" if candidate.verified else "screened"
        flops = (
            f", {format_flops(candidate.flops_per_step)}/step" if candidate.flops_per_step else ""
        )
        kind = "full-parameter" if candidate.full_parameter else "adapters"
        console.print(
            f"[bold]{rank}.[/] {candidate.optimizer}, {kind}, micro-batch "
            f"{candidate.batch_size} x {candidate.grad_accum}: peak {peak} ({checked}){flops}, "
            f"time x{candidate.relative_step_time:.2f}"
        )
        for lever, why in candidate.levers.items():
            console.print(f"     {lever}: {escape(why)}")
        console.print(f"     {escape(candidate.command)}", soft_wrap=True)
    if result.not_verified:
        console.print(
            "Screened to fit but not verified (not answers; check with effitrain estimate):"
        )
    for candidate in result.not_verified:
        peak = format_bytes(candidate.peak_tensor_bytes)
        console.print(f"  - screened peak {peak}: {escape(shlex.join(candidate.args))}")
    for note in result.notes:
        console.print(f"Note: {escape(note)}")
