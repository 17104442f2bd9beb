"""How the commands report failures: one line on stderr and a non-zero exit, no traceback.

Its own module so that the command modules can use it without importing ``effitrain.cli``,
which imports them.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from effitrain.errors import EffitrainError, first_line

DEBUG_ENV = "EFFITRAIN_DEBUG"


def debug_enabled() -> bool:
    """Whether EFFITRAIN_DEBUG asks for tracebacks (any value but empty, 0, false, no)."""
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one error line on stderr; return the Exit to raise (``raise fail(...) from None``)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn any error into one line on stderr and a non-zero exit.

    With EFFITRAIN_DEBUG=1 the traceback is printed first.
    """
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
        raise fail(
            f"{type(exc).__name__}: {first_line(exc, default='')} "
            f"(set {DEBUG_ENV}=1 to see the traceback)"
        ) from None
