"""``effitrain plan``'s answer: the budget, then each configuration that fits, best first."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from effitrain.cost import format_flops
from effitrain.memory.ledger import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from effitrain.results import PlanResult


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
    searched = (
        f"the longest sequence that fits: [bold]{result.longest:,} tokens[/] ({result.screened} "
        "lengths screened"
        if result.longest
        else f"{result.screened} configurations screened"
    )
    console.print(
        f"Budget {format_bytes(result.budget_bytes)} per device ({result.device_type}), "
        f"margin {format_bytes(result.margin_bytes)} ({margin}); {searched} with "
        f"{result.estimates} fake-tensor estimates in {result.seconds:.0f} s"
        + ("). Fastest first at that length:" if result.longest else ". Fastest first:")
    )
    for rank, candidate in enumerate(result.candidates, start=1):
        peak = format_bytes(candidate.peak_tensor_bytes)
        checked = "verified" if candidate.verified else "screened"
        flops = (
            f", {format_flops(candidate.flops_per_step)}/step" if candidate.flops_per_step else ""
        )
        kind = "full-parameter" if candidate.full_parameter else "adapters"
        phase = f" in {candidate.peak_phase}" if candidate.peak_phase else ""
        console.print(
            f"[bold]{rank}.[/] {candidate.optimizer}, {kind}, micro-batch "
            f"{candidate.batch_size} x {candidate.grad_accum}: peak {peak}{phase} ({checked})"
            f"{flops}, time x{candidate.relative_step_time:.2f}"
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
