"""The one exception type for mistakes a user can fix, and the one way to shorten a library's
message to a line."""


class EffitrainError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it, in one line.

    The CLI prints it without a traceback and exits non-zero; set ``EFFITRAIN_DEBUG=1`` to see
    the traceback.
    """


class MissingPackage(EffitrainError):
    """An optional package the options need is not installed; the message says what to install
    (``effitrain plan`` leaves out what needs it, instead of refusing the options)."""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first non-empty line of an exception's message (library messages run long).

    An empty message gives ``default``, or the exception's class name when no default is given.
    """
    text = str(exc).strip()
    if text:
        return text.splitlines()[0]
    return type(exc).__name__ if default is None else default
