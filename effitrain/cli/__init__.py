"""The ``effitrain`` command line. Thin: options become a config, one library call does the work.

Each command is a plain function in its own module; this package creates the Typer ``app`` and
registers them, so the command modules never import this package back. Nothing heavy is imported
here or in the command modules at import time, so ``--help`` is instant (a test checks that
torch, transformers, accelerate and datasets stay out of ``sys.modules``).
"""

from __future__ import annotations

import sys

import typer

from effitrain.cli import compare, estimate, inspect_state, optimizers, train

app = typer.Typer(
    name="effitrain",
    help="Memory-efficient training for Hugging Face models, with the memory made visible.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Registration order is the order `effitrain --help` lists them in.
app.command("inspect-state")(inspect_state.inspect_state)
app.command("optimizers")(optimizers.optimizers)
app.command("train")(train.train)
app.command("estimate")(estimate.estimate)
app.command("compare")(compare.compare)


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
