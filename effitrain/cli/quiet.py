"""Keep the libraries' chatter out of effitrain's output, each by its own logger or switch.

Only what a user cannot act on is silenced (progress bars of internal steps, info logs, notices
about optional kernels that this machine cannot load); effitrain's own output is untouched.
"""

from __future__ import annotations

import logging

QUIET_LOGGERS = (
    # bitsandbytes asks the `kernels` package for an optional 4-bit CPU kernel when imported
    # (peft imports it): offline, `kernels` warns that it skipped the publisher check, and
    # bitsandbytes warns when the kernel cannot load.
    "kernels",
    "bitsandbytes.backends.cpu.ops",
    # torchao (imported by transformers when installed): CUDA-only kernels a CPU build cannot
    # load, and a torch pytree deprecation notice about two of its enums.
    "torchao",
    "torch.utils._pytree",
)


# logger -> the start of a message it logs that says nothing a user can act on.
QUIET_MESSAGES = {
    # Accelerate's save_state, on every checkpoint of a model with tied weights (an output
    # layer tied to the embeddings): it saves the tied tensor once, as expected, and warns.
    "accelerate.utils.other": "Removed shared tensor",
}


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        # Accelerate's multi-process adapter puts "[RANK n] " before the message.
        return not record.getMessage().split("] ", 1)[-1].startswith(self.start)


def quiet_libraries() -> None:
    """Silence the loggers above (before the libraries are imported), the messages above, and
    the datasets and transformers progress bars and info logs. Errors still show."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, start in QUIET_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))

    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's 'Writing model shards'
