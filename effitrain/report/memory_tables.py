"""The memory tables a run ends with: the optimizer-state ledger, the memory breakdown, the
processes side by side. ``inspect-state`` shows a checkpoint's ledger the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.memory.ledger import format_bytes

if TYPE_CHECKING:
    from rich.table import Table

    from effitrain.memory.ledger import OptimizerStateLedger
    from effitrain.results import MemoryRecord, TrainResult


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

    table = Table(title=f"Memory ({', '.join(memory.levers) or 'no levers'})", title_justify="left")
    table.add_column("what")
    table.add_column("measured", justify="right")
    table.add_column("at peak", justify="right")
    table.add_column("fp32 AdamW, no levers", justify="right")
    _add_part_rows(table, memory, optimizer)
    host = [row for row in memory.lever_rows if row.part_of is None]
    if host:
        table.add_section()
    for row in host:  # the offload levers' host memory: not in the device's peak
        table.add_row(row.label, format_bytes(row.measured), "—", "—")
    table.add_section()
    _add_peak_rows(table, memory, run)
    table.caption = _memory_caption(memory)
    table.caption_justify = "left"
    return table


def _add_part_rows(table: Table, memory: MemoryRecord, optimizer: str) -> None:
    """One row per part of the step's memory, each followed by the levers' rows inside it."""
    step = memory.step_memory
    at_peak = step.at_peak if step else {}
    kind_peaks = step.kind_peaks if step else {}
    base = memory.baseline
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
            _versus(measured, baseline) if measured is not None and baseline is not None else "—",
        )
        for row in memory.lever_rows:
            if row.part_of == kind:
                at = format_bytes(row.at_peak) if row.at_peak is not None else ""
                table.add_row(row.label, format_bytes(row.measured), at, "")
    other = at_peak.get("buffers", 0) + at_peak.get("other", 0)
    if other:
        table.add_row("buffers, other", "", format_bytes(other), "")
    if memory.generation_bytes is not None:
        table.add_row(
            "generation: KV cache, logits", format_bytes(memory.generation_bytes), "—", ""
        )


def _add_peak_rows(table: Table, memory: MemoryRecord, run: TrainResult | None) -> None:
    """The peaks: of the step's tensors, of what the tracker saw beside CUDA's, of the run."""
    step = memory.step_memory
    phase = memory.peak_phase
    if step and phase is not None:
        for name, peak in (
            ("generation", memory.generation_peak_bytes),
            ("training", step.peak_tensor_bytes),
        ):
            table.add_row(f"{name} phase peak", "", format_bytes(peak or 0), "")
    if memory.peak_tensor_bytes is not None:
        table.add_row(
            f"[bold]peak tensor memory[/]{f' ({phase})' if phase else ''}",
            "",
            f"[bold]{format_bytes(memory.peak_tensor_bytes)}[/]",
            "—",
        )
    if step and step.cuda_max_allocated:
        table.add_row("tracked tensors", "", format_bytes(sum(step.at_peak.values())), "")
    if run is not None:
        peak_label = {"cuda_peak_allocated": "CUDA peak (run)", "peak_rss": "peak RSS"}.get(
            run.peak_memory_kind, run.peak_memory_kind
        )
        table.add_row(peak_label, format_bytes(run.peak_memory_bytes), "", "")


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
    if memory.generation_memory:
        lines.append(
            "the step's generation phase (its completions sampled before its first forward: "
            "the weights, the optimizer state, the KV cache and logits) is measured apart from "
            "its training phase (the parts above); the step's peak is the larger"
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
