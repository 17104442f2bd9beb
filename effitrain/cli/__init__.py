"""The ``effitrain`` command line. Thin: options become a config, one library call does the work.

Nothing heavy is imported here or in the command modules at import time, so ``--help`` is instant
(a test checks that torch, transformers, accelerate and datasets stay out of ``sys.modules``).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from effitrain.errors import EffitrainError

DEBUG_ENV = "EFFITRAIN_DEBUG"

app = typer.Typer(
    name="effitrain",
    help="Memory-efficient training for Hugging Face models, with the memory made visible.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one error line on stderr; return the Exit to raise (``raise fail(...) from None``)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn any error into one line on stderr and a non-zero exit; EFFITRAIN_DEBUG=1 re-raises."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    except EffitrainError as exc:
        if debug_enabled():
            traceback.print_exc()
        raise fail(str(exc)) from None
    except Exception as exc:  # a bug or a library failure we did not anticipate
        if debug_enabled():
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise fail(
            f"{type(exc).__name__}: {first} (set {DEBUG_ENV}=1 to see the traceback)"
        ) from None


# Register the commands (each module is light: heavy imports live inside the functions).
from effitrain.cli import inspect_state as _inspect_state  # noqa: E402,F401
from effitrain.cli import optimizers as _optimizers  # noqa: E402,F401
from effitrain.cli import train as _train  # noqa: E402,F401


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
