"""The public Python API: the true-storage optimizer ledger in one call.

::

    from effitrain import optimizer_memory

    print(optimizer_memory(optimizer))          # a live optimizer (after its first step)
    print(optimizer_memory("out/checkpoint-6"))  # or a state_dict, a saved file or folder

The usual hand-written ``sum(t.numel() * t.element_size() for state ...)`` done right: storages counted once, dtypes as
they are, and the comparison with fp32 AdamW for the same parameters. Accounting is
:mod:`effitrain.memory.ledger`'s, files are read by :mod:`effitrain.inspection`, the table is
:mod:`effitrain.report.memory_tables`'s; this module only puts them together. ``torch`` is
imported by those, inside their functions, when a measurement is made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from effitrain.memory import ledger

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["OptimizerMemory", "optimizer_memory"]


@dataclass
class OptimizerMemory:
    """What an optimizer keeps, measured from the storages that exist; ``to_dict`` uses the
    field names of ``effitrain train --metrics-json``.

    Numbers are this process's: under FSDP or DeepSpeed ZeRO that is its shard of the state.
    """

    optimizer_class: str
    """``torch.optim.adamw.AdamW`` for a live optimizer; for a state dict or file, the class
    the checkpoint names or one inferred from its state keys."""
    optimizer_state: ledger.OptimizerStateLedger
    """Per state key: tensors, elements, bytes and dtypes; totals (see
    :func:`effitrain.memory.ledger.optimizer_state_ledger`)."""
    adamw_equivalent_elements: int
    """What fp32 ``torch.optim.AdamW`` would keep for the same parameters (see
    :func:`effitrain.memory.ledger.adamw_state_size`)."""
    adamw_equivalent_bytes: int
    source: str
    """``"optimizer"``, ``"state_dict"``, or the path and what kind of checkpoint it is."""
    parameters: int
    """Parameter tensors behind the AdamW figure: the trainable parameters in a live optimizer's
    param_groups; for a state dict or file, those whose shape the state reveals."""
    params_without_shape: int = 0
    """State dict or file only: parameters with state of unknown shape, left out of the AdamW
    figure."""

    @property
    def elements(self) -> int:
        return self.optimizer_state.elements

    @property
    def bytes(self) -> int:
        return self.optimizer_state.bytes

    @property
    def by_key(self) -> dict[str, ledger.StateKeyUsage]:
        return self.optimizer_state.by_key

    @property
    def is_empty(self) -> bool:
        """No parameter has state yet: torch optimizers create it at the first ``step()``."""
        return self.optimizer_state.params_with_state == 0

    @property
    def ratio_to_adamw(self) -> float | None:
        """State bytes over AdamW's; None when there is no AdamW reference (no parameters)."""
        if not self.adamw_equivalent_bytes:
            return None
        return self.bytes / self.adamw_equivalent_bytes

    @property
    def name(self) -> str:
        """The class name without its module (``AdamW``), or the inferred description."""
        if " " in self.optimizer_class:
            return self.optimizer_class
        return self.optimizer_class.rpartition(".")[2]

    def metrics(self) -> dict[str, int]:
        """Flat numbers for a metrics logger: ``optimizer_state_bytes``, ``…_elements``,
        ``adamw_equivalent_bytes``, ``adamw_equivalent_elements``."""
        return {
            "optimizer_state_bytes": self.bytes,
            "optimizer_state_elements": self.elements,
            "adamw_equivalent_bytes": self.adamw_equivalent_bytes,
            "adamw_equivalent_elements": self.adamw_equivalent_elements,
        }

    def to_dict(self) -> dict[str, Any]:
        """One JSON-ready object; ``optimizer_state`` and ``adamw_equivalent_*`` as in the
        metrics JSON of ``effitrain train``."""
        return {
            "optimizer_class": self.optimizer_class,
            "source": self.source,
            "optimizer_state": self.optimizer_state.to_dict(),
            "adamw_equivalent_bytes": self.adamw_equivalent_bytes,
            "adamw_equivalent_elements": self.adamw_equivalent_elements,
            "parameters": self.parameters,
            "params_without_shape": self.params_without_shape,
        }

    def headline(self) -> str:
        """One line: the state against AdamW's, or why there is no state yet."""
        adamw = (
            f"{self.adamw_equivalent_elements:,} elements, "
            f"{ledger.format_bytes(self.adamw_equivalent_bytes)}"
        )
        if self.is_empty:
            when = {
                "optimizer": "the optimizer has not taken a step yet: torch optimizers create "
                "their state at the first optimizer.step()",
                "state_dict": "the state dict was taken before the first optimizer.step()",
            }.get(self.source, "saved before the first optimizer.step()")
            if not self.adamw_equivalent_bytes:
                return f"{self.name} state: empty ({when})"
            return f"{self.name} state: empty ({when}); fp32 AdamW would keep {adamw}"
        ratio = self.ratio_to_adamw
        compared = f"{ratio:.1%} of AdamW's {adamw}" if ratio is not None else "no AdamW reference"
        return (
            f"{self.name} state: {self.elements:,} elements, "
            f"{ledger.format_bytes(self.bytes)} ({compared})"
        )

    def summary(self) -> str:
        """Plain text: the headline, then one line per state key."""
        lines = [self.headline()]
        for key, usage in self.by_key.items():
            lines.append(
                f"  {key}: {usage.elements:,} elements, {ledger.format_bytes(usage.bytes)} "
                f"({', '.join(usage.dtypes)})"
            )
        if self.params_without_shape:
            lines.append(
                f"  note: {self.params_without_shape} parameter(s) with state of unknown shape "
                "are left out of the AdamW figure"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def table(self) -> Any:
        """The rich table ``effitrain train`` prints: one row per state key, then the total."""
        from effitrain.report.memory_tables import ledger_table

        return ledger_table(
            self.optimizer_state, f"Optimizer state: {self.name} ({self.optimizer_class})"
        )

    def print_table(self, console: Console | None = None) -> None:
        """Print :meth:`table` and the comparison with AdamW (stdout unless ``console``)."""
        from rich.console import Console

        console = console or Console(highlight=False)
        console.print(self.table())
        console.print(self.headline(), soft_wrap=True, markup=False)


def optimizer_memory(obj: Any) -> OptimizerMemory:
    """Measure an optimizer's state as it really is stored, and compare it with fp32 AdamW.

    Args:
        obj: one of

            - a live torch optimizer; wrappers that keep the real one in ``.optimizer``
              (Accelerate's ``AcceleratedOptimizer``, what a Trainer callback receives) are
              unwrapped. The AdamW figure counts the trainable parameters in its
              ``param_groups``, whether or not they have state yet;
            - an optimizer ``state_dict()`` (or its ``"state"`` mapping). Parameters are not
              in it: the AdamW figure uses the shapes their state reveals;
            - a path (``str`` or ``os.PathLike``) to anything ``effitrain inspect-state``
              reads: a ``torch.save`` file, an effitrain, Accelerate or Trainer checkpoint
              folder, or an output folder with ``checkpoint-*`` folders. Read safely
              (weights-only, memory-mapped); see :func:`effitrain.inspection.inspect_state`.

    Returns:
        The ledger and the AdamW comparison. Before the first ``optimizer.step()`` a torch
        optimizer has no state: ``is_empty`` is True and the summary says so.

    Raises:
        TypeError: ``obj`` is none of the above.
        EffitrainError: a path that holds no readable optimizer state.
    """
    if isinstance(obj, (str, os.PathLike)):
        return _from_path(obj)
    if isinstance(obj, Mapping):
        return _from_state_dict(obj)
    return _from_optimizer(obj)


def _from_optimizer(obj: Any) -> OptimizerMemory:
    optimizer = ledger.unwrap_optimizer(obj)
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(getattr(optimizer, "state", None), Mapping) or not isinstance(groups, list):
        raise TypeError(
            "optimizer_memory() takes a torch optimizer, an optimizer state_dict or a path, "
            f"not {type(obj).__name__}"
        )
    cls = type(optimizer)
    # Frozen parameters never get a gradient, so no optimizer keeps state for them.
    trainable = [p for group in groups for p in group["params"] if p.requires_grad]
    return OptimizerMemory(
        optimizer_class=f"{cls.__module__}.{cls.__qualname__}",
        optimizer_state=ledger.optimizer_state_ledger(optimizer),
        adamw_equivalent_elements=ledger.adamw_equivalent_elements(trainable),
        adamw_equivalent_bytes=ledger.adamw_equivalent_bytes(trainable),
        source="optimizer",
        parameters=len(trainable),
    )


def _from_state_dict(obj: Mapping[str, Any]) -> OptimizerMemory:
    from effitrain.inspection import infer_optimizer, infer_parameter

    state = obj.get("state") if "param_groups" in obj else obj
    if not isinstance(state, Mapping) or not all(isinstance(v, Mapping) for v in state.values()):
        raise TypeError(
            "optimizer_memory() takes an optimizer state_dict ({'state': ..., 'param_groups': "
            "...}) or its 'state' mapping; this mapping is neither"
        )
    shapes = [infer_parameter(entry)[0] for entry in state.values() if entry]
    known = [shape for shape in shapes if shape is not None]
    elements, nbytes = ledger.adamw_state_size(math.prod(shape) for shape in known)
    return OptimizerMemory(
        optimizer_class=infer_optimizer({"state": state, "param_groups": obj.get("param_groups")}),
        optimizer_state=ledger.optimizer_state_ledger(state),
        adamw_equivalent_elements=elements,
        adamw_equivalent_bytes=nbytes,
        source="state_dict",
        parameters=len(known),
        params_without_shape=len(shapes) - len(known),
    )


def _from_path(path: str | os.PathLike[str]) -> OptimizerMemory:
    from effitrain.inspection import inspect_state

    report = inspect_state(path)
    return OptimizerMemory(
        optimizer_class=report.optimizer_class,
        optimizer_state=report.ledger,
        adamw_equivalent_elements=report.adamw_equivalent_elements,
        adamw_equivalent_bytes=report.adamw_equivalent_bytes,
        source=f"{report.path} ({report.format})",
        parameters=len(report.params) - report.params_without_shape,
        params_without_shape=report.params_without_shape,
    )
