"""``effitrain inspect-state``'s report: the summary, the ledger, the largest states, the AdamW
comparison."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from effitrain.memory.ledger import format_bytes
from effitrain.report.memory_tables import ledger_table

if TYPE_CHECKING:
    from rich.console import Console

    from effitrain.results import StateReport


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
