"""``effitrain compare``'s table, and the columns its CSV and plot share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.cost import format_flops
from effitrain.memory.ledger import format_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console


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
