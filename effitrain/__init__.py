"""effitrain: memory-efficient training for Hugging Face models, with the memory made visible."""

from __future__ import annotations

from typing import Any

import effitrain.levers  # noqa: F401  # registers the levers: their options are config fields

__version__ = "0.1.0"

__all__ = ["OptimizerMemory", "__version__", "optimizer_memory"]


def __getattr__(name: str) -> Any:
    """The public Python API, imported on first use (PEP 562), so that ``import effitrain``
    (and with it ``effitrain --help``) loads no torch, transformers or rich."""
    if name in ("OptimizerMemory", "optimizer_memory"):
        from effitrain import python_api

        value = getattr(python_api, name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "OptimizerMemory", "optimizer_memory"})
