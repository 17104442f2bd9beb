"""The one exception type for mistakes a user can fix."""


class EffitrainError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it, in one line.

    The CLI prints it without a traceback and exits non-zero; set ``EFFITRAIN_DEBUG=1`` to see
    the traceback.
    """
