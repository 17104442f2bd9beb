"""The reference model that DPO's loss and GRPO's KL penalty hold, built by the loss once the
run is prepared (its ``after_prepare``): ``--reference adapters|precompute|copy``.

DPO compares the trained model's log-probs of each answer with a frozen reference's; GRPO with
``--beta`` > 0 penalises each completion token's KL to it. How the reference's log-probs are
paid for is a memory choice (its options, checks and what it shows: the ``reference`` lever,
:mod:`effitrain.levers.reference`):

- ``adapters`` (the default with ``--lora-rank``): the trained model itself with peft's adapters
  switched off (``disable_adapter()``), as TRL does for a PEFT model without a ``ref_model``: the
  frozen base *is* the reference. No second copy: 0 bytes, one more no-grad forward per step.
- ``precompute`` (DPO's default for full-parameter runs; DPO's only: GRPO's completions are
  generated during training): before the first step, one pass over the training and validation
  data computes every pair's reference log-probs with the initial model, into a table
  ``[N+M, 2]`` fp32 keyed by the batch's ``example`` id (so shuffling, a resume or another
  number of processes finds them), as TRL's ``precompute_ref_log_probs``.
  Kept in each checkpoint (``reference_logps.safetensors``) with a fingerprint of the data it
  was computed on, so that a resume does not recompute it: 8 bytes per pair.
- ``copy`` (GRPO's default for full-parameter runs): a frozen copy of the model as it starts
  (the same checkpoint; a preset's same seeded init; never a resumed run's weights) in
  ``--reference-dtype`` (fp32, bf16 or 4-bit NF4 through bitsandbytes), in eval mode, on the
  device: its weights' bytes, in the step's peak (the step probe tracks them).

Every provider answers ``logps(model, batch)``, the batch's log-probs as the loss scores them
(its ``reference_logps``: DPO's ``[2B]`` summed per sequence, chosen first; GRPO's ``[B, T]`` per
completion token over the temperature), fp32, no grad, in eval mode (no dropout; no gradient
checkpointing, which transformers applies in training mode only, as TRL's reference forward
runs without it).

ORPO and SimPO, and GRPO with ``--beta`` 0, need no reference: ``--reference`` with them is
refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from effitrain.errors import EffitrainError
from effitrain.levers.reference import TABLE_FILE, copy_dtype, how

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.parts import RunParts
    from effitrain.report.live import Reporter

FINGERPRINT_BATCH = 64
"""Examples per batch when the data's fingerprint is computed (no model: the collate only)."""


class Scorer(Protocol):
    """What a provider asks of the loss: the batch's log-probs as the loss scores them (DPO:
    each sequence's summed answer log-probs; GRPO: each completion token's)."""

    def reference_logps(self, model: Any, unwrapped: Any, batch: dict[str, Any]) -> Any: ...


# -- the providers ---------------------------------------------------------------------------


def make_provider(run: RunParts, loss: Scorer) -> Provider:
    """The run's reference provider, as ``--reference`` says (``loss``: the one it serves)."""
    used = how(run.config)
    unwrapped = run.accelerator.unwrap_model(run.model)
    if used == "adapters":
        return AdaptersOff(unwrapped, loss)
    if used == "copy":
        return FrozenCopy(unwrapped, loss, run.config)
    return Precomputed(run, loss)


class Provider:
    """A reference: the batch's log-probs, what it holds, and what it does at the run's moments
    (most providers do nothing at them)."""

    dtype: str | None
    """Its weights' or table's dtype (None: it holds none)."""

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        """The loss's log-probs of ``batch`` under the reference (DPO: ``[2B]``, chosen rows
        first; GRPO: ``[B, T]``), fp32, no grad."""
        raise NotImplementedError

    def bytes(self) -> int:
        """What it holds on the device besides the trained model."""
        raise NotImplementedError

    def before_training(self, run: RunParts, reporter: Reporter) -> None:
        """After the build and any resume, before the first step."""

    def step_tensors(self) -> list[Any]:
        """Its modules and tensors that every step holds (for the step probe to count)."""
        return []

    def save(self, run: RunParts, folder: Path) -> None:
        """Keep what it computed in a checkpoint folder (every process calls it)."""

    def load(self, run: RunParts, folder: Path) -> None:
        """Read back what :meth:`save` kept."""


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout, no gradient checkpointing), then as it was."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _scored_logps(loss: Scorer, model: Any, unwrapped: Any, batch: dict[str, Any]) -> Any:
    return loss.reference_logps(model, unwrapped, batch)


class AdaptersOff(Provider):
    """The trained model with its adapters switched off: peft's ``disable_adapter()`` on the
    unwrapped model, the prepared one called (its wrapper's forward, as the step's)."""

    dtype = None

    def __init__(self, unwrapped: Any, loss: Scorer):
        self.unwrapped = unwrapped
        self.loss = loss

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad(), evaluating(self.unwrapped), self.unwrapped.disable_adapter():
            return _scored_logps(self.loss, model, self.unwrapped, batch).float()

    def bytes(self) -> int:
        return 0


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class FrozenCopy(Provider):
    """A frozen copy of the model as it starts, in ``--reference-dtype``, eval mode, no grads."""

    def __init__(self, unwrapped: Any, loss: Scorer, config: TrainConfig):
        import torch

        self.loss = loss
        self.dtype = copy_dtype(config)
        device = next(unwrapped.parameters()).device
        # Copied before any step or resume: the weights the run starts from (a checkpoint's as
        # read; a preset's seeded init), whatever it trains in.
        wanted = torch.float32 if self.dtype == "4bit" else getattr(torch, DTYPES[self.dtype])
        model = _copy_in(unwrapped, wanted)
        model.requires_grad_(False)
        if self.dtype == "4bit":
            from torch._subclasses.fake_tensor import is_fake

            from effitrain.levers.qlora_bnb import quantize_model

            if is_fake(next(model.parameters())):
                _quantize_fake(model, config)
            else:
                model = quantize_model(model, config, device)
        model.eval()
        self.model = model

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad():
            return _scored_logps(self.loss, self.model, self.model, batch).float()

    def bytes(self) -> int:
        from effitrain.memory.ledger import parameter_bytes

        return parameter_bytes(self.model)

    def step_tensors(self) -> list[Any]:
        return [self.model]


def _quantize_fake(model: torch.nn.Module, config: TrainConfig) -> None:
    """``effitrain estimate``: the copy's Linear layers in 4-bit as the QLoRA lever quantizes a
    run's (bitsandbytes' ``Linear4bit``), each weight given the packed codes and quant state that
    bitsandbytes' own shape logic makes of the fake fp32 weight (:func:`quantized_like`: a fake
    tensor cannot become a ``Params4bit``)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from effitrain.levers.qlora_bnb import quantized_like, replace_linear_layers

    @contextlib.contextmanager
    def on_meta() -> Iterator[None]:
        # The new layers are made on the meta device, outside the fake mode (a fake tensor
        # cannot become a Params4bit), as the QLoRA lever makes a run's before an estimate
        # gives them storage.
        with unset_fake_temporarily(), torch.device("meta"):
            yield

    replace_linear_layers(
        model,
        config,
        new_weight=lambda layer, weight: quantized_like(layer.weight, weight.detach().contiguous()),
        replacing=on_meta,
    )


def _copy_in(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    """A deep copy of ``model`` with its floating-point parameters and buffers in ``dtype``,
    each cast as it is copied (a bf16 copy of an fp32 model never holds a second fp32 one;
    ``.to(dtype)`` could not swap an estimate's fake parameters either); a tensor shared by
    several modules (tied weights) stays shared."""
    import copy
    import warnings

    import torch

    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype and id(tensor) not in memo:
            cast = tensor.detach().to(dtype)
            is_parameter = isinstance(tensor, torch.nn.Parameter)
            memo[id(tensor)] = (
                torch.nn.Parameter(cast, requires_grad=False) if is_parameter else cast
            )
    with warnings.catch_warnings():
        # torch's deepcopy reads an estimate's fake tensors' data pointers (and warns).
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        return copy.deepcopy(model, memo)


class Precomputed(Provider):
    """Every pair's reference log-probs, ``table[example] = (chosen, rejected)``, computed once
    with the initial model (:meth:`compute`) or read from a checkpoint (:meth:`load`)."""

    dtype = "fp32"

    def __init__(self, run: RunParts, loss: Scorer):
        import torch

        self.loss = loss
        self.examples = len(run.data.train) + len(run.data.validation or ())
        self.table = torch.zeros(self.examples, 2, dtype=torch.float32, device=_device(run))
        self.filled = False

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        rows = self.table[batch["example"].to(self.table.device)]
        return rows.t().reshape(-1)  # chosen of every pair, then rejected: the batch's order

    def bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def compute(self, run: RunParts) -> None:
        """One no-grad pass over the training and validation data in order, each process its
        share, gathered to every process."""
        import torch

        accelerator = run.accelerator
        unwrapped = accelerator.unwrap_model(run.model)
        with torch.no_grad(), evaluating(unwrapped):
            for loader in _loaders(run):
                for batch in _ordered(loader, run, shard=True):
                    logps = _scored_logps(self.loss, run.model, unwrapped, batch).float()
                    size = len(batch["example"])
                    pairs = torch.stack([logps[:size], logps[size:]], dim=1)
                    ids, pairs = accelerator.gather_for_metrics((batch["example"], pairs))
                    self.table[ids.to(self.table.device)] = pairs.to(self.table.device)
        self.fingerprint = data_fingerprint(run)
        self.filled = True

    def before_training(self, run: RunParts, reporter: Reporter) -> None:
        """Compute the table, unless a checkpoint gave it (:meth:`load`); say which."""
        import time

        if self.filled:
            reporter.status("reference: log-probs read from the checkpoint, not recomputed")
            return
        reporter.status(
            f"reference: computing the log-probs of {self.examples:,} pairs with the initial "
            "model (one pass over the training and validation data)"
        )
        start = time.monotonic()
        self.compute(run)
        reporter.status(f"reference: log-probs computed in {time.monotonic() - start:.1f} s")

    def step_tensors(self) -> list[Any]:
        return [self.table]

    def save(self, run: RunParts, folder: Path) -> None:
        """The table, written by the main process (:data:`TABLE_FILE`)."""
        from safetensors.torch import save_file

        if not run.accelerator.is_main_process:
            return
        save_file(
            {"logps": self.table.detach().cpu().contiguous()},
            str(folder / TABLE_FILE),
            metadata={"examples": str(self.examples), "data": self.fingerprint},
        )

    fingerprint = ""
    """The data's :func:`fingerprint`, once known."""

    def load(self, run: RunParts, folder: Path) -> None:
        """Read the table a checkpoint kept, refused where it was computed on other data.

        Raises:
            EffitrainError: the file is missing or unreadable, or the data differs.
        """
        from safetensors import SafetensorError, safe_open

        path = folder / TABLE_FILE
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                table = handle.get_tensor("logps")
        except (OSError, SafetensorError) as exc:
            raise EffitrainError(
                f"cannot resume from {path.parent}: its precomputed reference log-probs "
                f"({path.name}) cannot be read ({exc})"
            ) from exc
        wanted = data_fingerprint(run)
        if metadata.get("data") != wanted or tuple(table.shape) != tuple(self.table.shape):
            raise EffitrainError(
                f"cannot resume from {path.parent}: its precomputed reference log-probs were "
                f"computed on other data ({metadata.get('examples', '?')} examples, this run has "
                f"{self.examples}); resume with the same data, or start a new run"
            )
        self.table.copy_(table.to(self.table.device))
        self.fingerprint = wanted
        self.filled = True


def _device(run: RunParts) -> Any:
    return run.accelerator.device


def _loaders(run: RunParts) -> list[Any]:
    """The training and validation loaders (ids 0..N-1, then N..N+M-1), where there are."""
    return [loader for loader in (run.train_loader, run.eval_loader) if loader is not None]


def _ordered(loader: Any, run: RunParts, shard: bool) -> Any:
    """``loader``'s examples in their order (no shuffling), in batches of --batch-size; with
    ``shard``, each process its share, on its device (not registered with the Accelerator:
    its checkpoints save only the training loaders' states)."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    ordered = DataLoader(
        loader.dataset,
        batch_size=run.config.batch_size if shard else FINGERPRINT_BATCH,
        shuffle=False,
        collate_fn=loader.collate_fn,
    )
    if not shard:
        return ordered
    state = run.accelerator.state
    return prepare_data_loader(
        ordered,
        device=run.accelerator.device,
        num_processes=state.num_processes,
        process_index=state.process_index,
        put_on_device=True,
    )


def data_fingerprint(run: RunParts) -> str:
    """The data the table is keyed on: the example count and a hash of every pair's example
    id and token ids (chosen, then rejected, padding left out), in the example order; the same
    on every process and for any number of processes."""
    import hashlib

    digest = hashlib.sha256()
    count = 0
    for loader in _loaders(run):
        for batch in _ordered(loader, run, shard=False):
            size = len(batch["example"])
            for i in range(size):
                digest.update(int(batch["example"][i]).to_bytes(8, "little"))
                for row in (i, size + i):
                    ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
                    digest.update(ids.cpu().numpy().astype("int64").tobytes())
            count += size
    return f"{count}:{digest.hexdigest()}"
