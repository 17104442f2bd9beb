"""The ``effitrain`` command line. Thin: options become a config, one library call does the work.

Each command is a plain function in its own module; this package creates the Typer ``app`` and
registers them, so the command modules never import this package back. Nothing heavy is imported
here or in the command modules at import time, so ``--help`` is instant (a test checks that
torch, transformers, accelerate and datasets stay out of ``sys.modules``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from effitrain.cli import compare, estimate, inspect_state, optimizers, plan, train
from effitrain.cli.error_handling import usage_errors
from effitrain.cli.help_layout import whole_names


class _Plain:
    """What every command shares: help without type tags (typer shows ``<bool>`` for a flag,
    which takes no value, and ``<path>`` beside an argument's name), and usage errors as one
    ``error:`` line."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
            if getattr(param, "param_type_name", "") == "argument":
                param.display_type_rich = _no_type  # its name (a metavar) says what it is
        return params

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with usage_errors():
            return super().make_context(*args, **kwargs)  # type: ignore[misc]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with whole_names():  # option names never cut, at any width
            super().format_help(ctx, formatter)  # type: ignore[misc]


def _no_type(ctx: Any) -> None:
    return None


class _Command(_Plain, TyperCommand):
    pass


class _Group(_Plain, TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        # A command's own options are parsed here, inside the group's invoke.
        with usage_errors():
            return super().invoke(ctx)


def _paragraphs(doc: str) -> str:
    """A docstring as help: each paragraph one line, for the terminal to wrap (typer's rich
    mode keeps a docstring's line breaks)."""
    return "\n\n".join(" ".join(part.split()) for part in inspect.cleandoc(doc).split("\n\n"))


app = typer.Typer(
    name="effitrain",
    cls=_Group,
    help="Memory-efficient training for Hugging Face models, with the memory made visible.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Registration order is the order `effitrain --help` lists them in.
for name, command in (
    ("train", train.train),
    ("estimate", estimate.estimate),
    ("plan", plan.plan),
    ("compare", compare.compare),
    ("inspect-state", inspect_state.inspect_state),
    ("optimizers", optimizers.optimizers),
):
    app.command(name, cls=_Command, help=_paragraphs(command.__doc__ or ""))(command)


def _show_version(value: bool) -> None:
    if value:
        from effitrain import __version__

        typer.echo(f"effitrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Memory-efficient training for Hugging Face models, with the memory made visible."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    app(args=argv if argv is not None else sys.argv[1:], prog_name="effitrain")
