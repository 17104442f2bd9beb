"""The options panels of ``--help``, with every option's name whole at any width.

typer draws a panel as a table of five columns (names, short names, ``--no-`` names, metavar,
help); at 80 columns rich cuts the names to fit (``--gradient-checkpoint…``). Here the names and
the metavar share one column that is never cut; where it leaves the help too narrow, each option
is a line of its own with its help indented below it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

NARROWEST_HELP = 40
"""Below this many columns for the help beside the names, the help goes below them."""


def _names(param: Any, ctx: Any) -> Any:
    """``--optim NAME`` (``* PATH`` for a required argument), and ``--no-…`` on a second line."""
    from rich.text import Text
    from typer import rich_utils

    text = Text(no_wrap=True)
    if param.required:
        text.append("* ", style=rich_utils.STYLE_REQUIRED_SHORT)
    if getattr(param, "param_type_name", "") == "argument":
        shown = getattr(param, "display_name_raw", None) or param.name.upper()  # older typers
        text.append(shown, style=rich_utils.STYLE_OPTION)
    else:
        text.append(", ".join(param.opts), style=rich_utils.STYLE_OPTION)
    metavar = param.display_type_rich(ctx=ctx)
    if metavar:
        text.append(f" {metavar}", style=rich_utils.STYLE_TYPES)
    if param.secondary_opts:
        text.append("\n" + ", ".join(param.secondary_opts), style=rich_utils.STYLE_NEGATIVE_OPTION)
    return text


def options_panel(
    *, name: str, params: list[Any], ctx: Any, markup_mode: Any, console: Any, **_: Any
) -> None:
    """Print one panel of options (typer's ``_print_options_panel``, same arguments)."""
    from rich.console import Group
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table
    from typer import rich_utils

    if not params:
        return
    rows = [
        (
            _names(param, ctx),
            rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode),
        )
        for param in params
    ]
    inner = console.width - 4  # the panel's border and padding
    names_width = max(line.cell_len for names, _ in rows for line in names.split("\n"))
    if inner - names_width - 1 >= NARROWEST_HELP:
        body: Any = Table(show_header=False, box=None, padding=(0, 1), pad_edge=False, expand=True)
        body.add_column(no_wrap=True, min_width=names_width)
        body.add_column(ratio=1)
        for names, help_text in rows:
            body.add_row(names, help_text)
    else:
        body = Group(
            *(
                part
                for names, help_text in rows
                for part in (names, Padding(help_text, (0, 0, 0, 4)))
            )
        )
    console.print(
        Panel(
            body,
            border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
            title=name,
            title_align=rich_utils.ALIGN_OPTIONS_PANEL,
        )
    )


@contextmanager
def whole_names() -> Iterator[None]:
    """typer's help, its options panels drawn by :func:`options_panel` (typer's own where its
    private helpers are not there)."""
    from typer import rich_utils

    helpers = ("_get_parameter_help", "_print_options_panel")
    if not all(hasattr(rich_utils, name) for name in helpers):  # a typer it was not written for
        yield
        return
    original = rich_utils._print_options_panel
    rich_utils._print_options_panel = options_panel
    try:
        yield
    finally:
        rich_utils._print_options_panel = original
