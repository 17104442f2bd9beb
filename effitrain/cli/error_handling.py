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


def click_exception() -> type[Exception]:
    """click's ClickException (reached through typer's public BadParameter: typer may bundle
    its own click, whose classes are not click's)."""
    return next(k for k in typer.BadParameter.__mro__ if k.__name__ == "ClickException")


def usage_message(exc: Exception) -> str:
    """A click usage error's message in effitrain's style: ``no such option: --x``."""
    message = exc.format_message()  # type: ignore[attr-defined]
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    return message


@contextmanager
def usage_errors() -> Iterator[None]:
    """Parse errors (an unknown option, a value that does not parse) as one ``error:`` line
    that says where to look, instead of click's boxed message."""
    try:
        yield
    except click_exception() as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # not an error: click shows the help
            raise
        ctx = getattr(exc, "ctx", None)
        message = usage_message(exc)
        if ctx is not None:
            message = f"{message.removesuffix('.')} (see {ctx.command_path} --help)"
        raise fail(message, exc.exit_code) from None  # type: ignore[attr-defined]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one error line on stderr; return the Exit to raise (``raise fail(...) from None``).

    Under ``accelerate launch`` every process meets the same refusal: only the main one
    (``RANK`` 0) prints it, the others exit with the same code quietly."""
    if os.environ.get("RANK", "0") in ("", "0"):
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
