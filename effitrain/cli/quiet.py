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


def quiet_libraries() -> None:
    """Silence the loggers above (before the libraries are imported) and the datasets and
    transformers progress bars and info logs. Errors still show."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)

    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's 'Writing model shards'
