"""``effitrain estimate``'s tables: the estimates side by side (or one row each), each process's
share, the host RAM, the notes; against a measured run, the estimate's error."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.cost import format_flops
from effitrain.memory.ledger import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from effitrain.results import Estimate, HostMemory


ESTIMATE_FIELDS = (
    ("parameters", "parameter_bytes"),
    ("  trained", "trainable_parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state.bytes"),
    ("activations", "activation_bytes"),
    ("peak tensor memory", "peak_tensor_bytes"),
)
"""The parts an estimate gives: a label and the metrics JSON's field (dotted: nested)."""

PHASE_FIELDS = (
    ("generation: KV cache, logits", "generation_bytes"),
    ("generation phase peak", "generation_peak_bytes"),
    ("training phase peak", "training_peak_bytes"),
)
"""A step's two phases where the loss generates (GRPO), before its peak."""


def estimate_fields(result: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The fields of an estimate's (or a run's) metrics JSON: :data:`ESTIMATE_FIELDS`, with
    :data:`PHASE_FIELDS` before the peak where it has a generation phase."""
    if result.get("generation_peak_bytes") is None:
        return ESTIMATE_FIELDS
    return ESTIMATE_FIELDS[:-1] + PHASE_FIELDS + ESTIMATE_FIELDS[-1:]


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
    assumed = "Every example is assumed --max-length tokens long."
    if results[0].memory.generation_memory is not None:
        assumed = (
            "The step's generation phase (its completions sampled, before its first forward) "
            "and its training phase are measured apart; the peak is the larger. Every prompt "
            "is assumed as long as the data's longest (--max-length where given), every "
            "completion --max-completion-length (no early eos)."
        )
    console.print(
        "Peak tensor memory: the most bytes of live tensors at once in one optimizer step (the "
        "run's memory table); a process holds more (libraries, the CUDA context, allocator "
        f"caching). {assumed}"
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
    loss = first.memory.loss
    if "max_completion_length" in loss:  # GRPO: prompts and their completions
        prompts = settings.batch_size // loss["num_generations"]
        return (
            f"Estimate: {settings.model}, batch {settings.batch_size} completions ({prompts} "
            f"prompts x {loss['num_generations']}) of {settings.max_length} + "
            f"{loss['max_completion_length']} tokens{micro}"
        )
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
    for label, key in estimate_fields(fields[0]):
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
    if fields[0].get("peak_phase"):
        measured = [(against["measured"].get("peak_phase") or "-"), ""] if against else []
        table.add_row("peak phase", *(f.get("peak_phase") or "-" for f in fields), *measured)
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
    step = f", the step's host tensors {format_bytes(host.step_bytes)}" if host.step_bytes else ""
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
