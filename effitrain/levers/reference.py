"""DPO's reference model as a memory lever: ``--reference adapters|precompute|copy``.

DPO compares the trained model's log-probs of each answer with a frozen reference's. How the
reference's log-probs are paid for is a memory choice, and this lever makes it:

- ``adapters`` (the default with ``--lora-rank``): the trained model itself with peft's adapters
  switched off (``disable_adapter()``), as TRL does for a PEFT model without a ``ref_model``: the
  frozen base *is* the reference. No second copy: 0 bytes, one more no-grad forward per step.
- ``precompute`` (the default for full-parameter runs): before the first step, one pass over the
  training and validation data computes every pair's reference log-probs with the initial
  model, into a table ``[N+M, 2]`` fp32 keyed by the batch's ``example`` id (so shuffling, a
  resume or another number of processes finds them), as TRL's ``precompute_ref_log_probs``.
  Kept in each checkpoint (``reference_logps.safetensors``) with a fingerprint of the data it
  was computed on, so that a resume does not recompute it: 8 bytes per pair.
- ``copy``: a frozen copy of the model as it starts (the same checkpoint; a preset's same seeded
  init) in ``--reference-dtype`` (fp32, bf16 or 4-bit NF4 through bitsandbytes), in eval mode,
  on the device: its weights' bytes, in the step's peak (the step probe tracks them).

Every provider answers ``logps(model, batch) -> Tensor[2B]`` (chosen first, fp32, no grad),
through :func:`effitrain.tasks.preference_loss.sequence_logps`, in eval mode (no dropout; no
gradient checkpointing, which transformers applies in training mode only, as TRL's reference
forward runs without it). The preference loss reads the provider from its ``reference``
attribute, which this lever sets once the run is prepared.

ORPO and SimPO need no reference: ``--reference`` with them is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError
from effitrain.levers.spec import BuiltRun, Lever
from effitrain.results import MemoryRow

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from effitrain.config import TrainConfig
    from effitrain.distributed import Launch
    from effitrain.memory.step import StepMemory
    from effitrain.report import Reporter

TABLE_FILE = "reference_logps.safetensors"
"""The precomputed table's file in a checkpoint folder."""
FINGERPRINT_BATCH = 64
"""Examples per batch when the data's fingerprint is computed (no model: the collate only)."""
COPY_SHARDINGS = ("fsdp1", "fsdp2", "deepspeed")


def how(config: TrainConfig) -> str:
    """``--reference`` as used: the given one, else adapters with --lora-rank, else precompute."""
    if config.reference is not None:
        return config.reference
    return "adapters" if _lora(config) else "precompute"


def _lora(config: TrainConfig) -> bool:
    from effitrain.levers.lora import LoRA

    return LoRA().is_on(config)


def copy_dtype(config: TrainConfig) -> str:
    """The copy's weights: ``--reference-dtype``, else the trained weights' (fp32 or bf16)."""
    if config.reference_dtype is not None:
        return config.reference_dtype
    return "bf16" if config.weights_dtype == "bf16" else "fp32"


class Reference(Lever):
    name = "reference"
    fields = ("reference", "reference_dtype")
    removes = (
        "the second model a DPO reference would hold (adapters, precompute), or part of it (a "
        "bf16 or 4-bit copy)"
    )
    task = "preference"
    time_cost = (
        "adapters and copy: one no-grad forward per micro-batch; precompute: one no-grad pass "
        "over the data before training"
    )

    def is_on(self, config: TrainConfig) -> bool:
        return config.task == "preference" and config.preference_loss == "dpo"

    def check(self, config: TrainConfig) -> None:
        if config.preference_loss != "dpo" and config.reference is not None:
            raise EffitrainError(
                f"--reference needs --preference-loss dpo ({config.preference_loss} uses no "
                "reference model); drop --reference"
            )
        if config.reference_dtype is not None and how(config) != "copy":
            raise EffitrainError(
                f"--reference-dtype needs --reference copy (this run's reference is "
                f"{how(config)}); add --reference copy, or drop --reference-dtype"
            )
        if config.reference == "copy" and _lora(config):
            # The frozen base under the adapters already is the reference, at no cost.
            raise EffitrainError(
                "--reference copy with --lora-rank would hold a second copy of the frozen base, "
                "which the adapters-off forward gives for 0 bytes; use --reference adapters"
            )
        if config.reference == "adapters" and not _lora(config):
            raise EffitrainError(
                "--reference adapters needs --lora-rank R (the base with the adapters switched "
                "off is the reference); add --lora-rank 8, or use --reference precompute"
            )

    def check_launch(self, config: TrainConfig, launch: Launch) -> None:
        if how(config) == "copy" and launch.sharding.kind in COPY_SHARDINGS:
            raise EffitrainError(
                f"--reference copy is not supported under {launch.sharding.description}: the "
                "copy's weights would be whole on every process; use --reference precompute"
            )
        if how(config) == "copy" and copy_dtype(config) == "4bit":
            from effitrain.quantization import require_bitsandbytes

            require_bitsandbytes()

    def after_prepare(self, run: BuiltRun) -> None:
        """Give the loss its provider: the copy is made here, before any step or resume (the
        model is then as it starts); the precomputed table is allocated here and filled by
        :meth:`before_training` (or read back by :meth:`load_extra`)."""
        run.loss.reference = make_provider(run)

    def before_training(self, run: BuiltRun, reporter: Reporter) -> None:
        import time

        provider = run.loss.reference
        if isinstance(provider, Precomputed) and not provider.filled:
            reporter.status(
                f"reference: computing the log-probs of {provider.examples:,} pairs with the "
                "initial model (one pass over the training and validation data)"
            )
            start = time.monotonic()
            provider.compute(run)
            reporter.status(f"reference: log-probs computed in {time.monotonic() - start:.1f} s")
        elif isinstance(provider, Precomputed):
            reporter.status("reference: log-probs read from the checkpoint, not recomputed")

    def step_tensors(self, run: BuiltRun) -> list[Any]:
        provider = getattr(run.loss, "reference", None)
        if isinstance(provider, FrozenCopy):
            return [provider.model]
        if isinstance(provider, Precomputed):
            return [provider.table]
        return []

    def banner(self, config: TrainConfig, model: torch.nn.Module) -> str:
        return {
            "adapters": "reference: the base with the adapters switched off (no second copy)",
            "precompute": "reference: log-probs precomputed in one pass before training, kept "
            "with checkpoints",
            "copy": f"reference: a frozen {copy_dtype(config)} copy of the model, in the step",
        }[how(config)]

    def metrics(self, run: BuiltRun) -> dict[str, Any]:
        provider = run.loss.reference
        return {
            "reference": {
                "how": how(run.config),
                "dtype": provider.dtype,
                "bytes": provider.bytes(),
            }
        }

    def memory_rows(self, metrics: dict[str, Any], step: StepMemory | None) -> list[MemoryRow]:
        reference = metrics.get("reference")
        if not reference:
            return []
        label = {
            "adapters": "  + reference: adapters switched off (no copy)",
            "precompute": "  + reference: precomputed log-probs (at peak: in other)",
            "copy": f"  + reference: frozen {reference['dtype']} copy",
        }[reference["how"]]
        # The step probe tracks the copy's weights (as parameters) and the table (as other):
        # both exist before the step and live through it, so all of them are in its peak.
        at_peak = reference["bytes"] if step is not None else None
        return [MemoryRow(label, reference["bytes"], part_of="parameters", at_peak=at_peak)]

    def estimate_reads_data(self, config: TrainConfig) -> bool:
        return how(config) == "precompute"  # the table has a row per example

    def estimate_notes(self, config: TrainConfig) -> list[str]:
        return {
            "adapters": ["reference: the adapters-off forward runs in the estimated step"],
            "precompute": [
                "reference: the precomputed table's bytes are counted (the pass before training "
                "is not run: it frees what it holds before the first step)"
            ],
            "copy": [f"reference: the frozen {copy_dtype(config)} copy's weights are in the peak"],
        }[how(config)]

    def check_checkpoint(self, run: BuiltRun, checkpoint: Path) -> None:
        if how(run.config) == "precompute" and not (checkpoint / TABLE_FILE).is_file():
            raise EffitrainError(
                f"cannot resume from {checkpoint}: it holds no precomputed reference log-probs "
                f"({TABLE_FILE}); it was not written by a --reference precompute run"
            )

    def save_extra(self, run: BuiltRun, folder: Path) -> None:
        provider = run.loss.reference
        if isinstance(provider, Precomputed) and run.accelerator.is_main_process:
            provider.save(folder / TABLE_FILE)

    def load_extra(self, run: BuiltRun, folder: Path) -> None:
        provider = run.loss.reference
        if isinstance(provider, Precomputed):
            provider.load(folder / TABLE_FILE, run)


# -- the providers ---------------------------------------------------------------------------


def make_provider(run: BuiltRun) -> Any:
    """The run's reference provider, as ``--reference`` says."""
    used = how(run.config)
    unwrapped = run.accelerator.unwrap_model(run.model)
    if used == "adapters":
        return AdaptersOff(unwrapped, run.loss)
    if used == "copy":
        return FrozenCopy(unwrapped, run.loss, run.config)
    return Precomputed(run)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout, no gradient checkpointing), then as it was."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _sequence_logps(loss: Any, model: Any, unwrapped: Any, batch: dict[str, Any]) -> Any:
    from effitrain.tasks.preference_loss import sequence_logps

    return sequence_logps(getattr(loss, "choice", None), model, unwrapped, batch, average=False)


class AdaptersOff:
    """The trained model with its adapters switched off: peft's ``disable_adapter()`` on the
    unwrapped model, the prepared one called (its wrapper's forward, as the step's)."""

    dtype = None

    def __init__(self, unwrapped: Any, loss: Any):
        self.unwrapped = unwrapped
        self.loss = loss

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad(), evaluating(self.unwrapped), self.unwrapped.disable_adapter():
            return _sequence_logps(self.loss, model, self.unwrapped, batch).float()

    def bytes(self) -> int:
        return 0


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class FrozenCopy:
    """A frozen copy of the model as it starts, in ``--reference-dtype``, eval mode, no grads."""

    def __init__(self, unwrapped: Any, loss: Any, config: TrainConfig):
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

            from effitrain.quantization import quantize_model

            if is_fake(next(model.parameters())):
                _quantize_fake(model, config)
            else:
                model = quantize_model(model, config, device)
        model.eval()
        self.model = model

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad():
            return _sequence_logps(self.loss, self.model, self.model, batch).float()

    def bytes(self) -> int:
        from effitrain.memory.ledger import parameter_bytes

        return parameter_bytes(self.model)


def _quantize_fake(model: torch.nn.Module, config: TrainConfig) -> None:
    """``effitrain estimate``: the copy's Linear layers in 4-bit as the QLoRA lever quantizes a
    run's (bitsandbytes' ``Linear4bit``), each weight given the packed codes and quant state that
    bitsandbytes' own shape logic makes of the fake fp32 weight (:func:`quantized_like`: a fake
    tensor cannot become a ``Params4bit``)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from effitrain.quantization import quantized_like, replace_linear_layers

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


class Precomputed:
    """Every pair's reference log-probs, ``table[example] = (chosen, rejected)``, computed once
    with the initial model (:meth:`compute`) or read from a checkpoint (:meth:`load`)."""

    dtype = "fp32"

    def __init__(self, run: BuiltRun):
        import torch

        self.examples = len(run.data.train) + len(run.data.validation or ())
        self.table = torch.zeros(self.examples, 2, dtype=torch.float32, device=_device(run))
        self.filled = False

    def logps(self, model: Any, batch: dict[str, Any]) -> Any:
        rows = self.table[batch["example"].to(self.table.device)]
        return rows.t().reshape(-1)  # chosen of every pair, then rejected: the batch's order

    def bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def compute(self, run: BuiltRun) -> None:
        """One no-grad pass over the training and validation data in order, each process its
        share, gathered to every process."""
        import torch

        accelerator = run.accelerator
        unwrapped = accelerator.unwrap_model(run.model)
        with torch.no_grad(), evaluating(unwrapped):
            for loader in _loaders(run):
                for batch in _ordered(loader, run, shard=True):
                    logps = _sequence_logps(run.loss, run.model, unwrapped, batch).float()
                    size = len(batch["example"])
                    pairs = torch.stack([logps[:size], logps[size:]], dim=1)
                    ids, pairs = accelerator.gather_for_metrics((batch["example"], pairs))
                    self.table[ids.to(self.table.device)] = pairs.to(self.table.device)
        self.fingerprint = data_fingerprint(run)
        self.filled = True

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(
            {"logps": self.table.detach().cpu().contiguous()},
            str(path),
            metadata={"examples": str(self.examples), "data": self.fingerprint},
        )

    fingerprint = ""
    """The data's :func:`fingerprint`, once known."""

    def load(self, path: Path, run: BuiltRun) -> None:
        """Read the table a checkpoint kept, refused where it was computed on other data.

        Raises:
            EffitrainError: the file is missing or unreadable, or the data differs.
        """
        from safetensors import SafetensorError, safe_open

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


def _device(run: BuiltRun) -> Any:
    return run.accelerator.device


def _loaders(run: BuiltRun) -> list[Any]:
    """The training and validation loaders (ids 0..N-1, then N..N+M-1), where there are."""
    return [loader for loader in (run.train_loader, run.eval_loader) if loader is not None]


def _ordered(loader: Any, run: BuiltRun, shard: bool) -> Any:
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


def data_fingerprint(run: BuiltRun) -> str:
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
