"""The host side of a run: the RAM (resident memory) its processes need on one machine, besides
what the device step holds on a GPU. ``effitrain estimate`` reports it as ``host_peak_bytes``.

A model, not a measurement; ``benchmarks/loading`` compares it with the peak RSS of real runs,
and what it assumes is what that benchmark saw (transformers 5 on the CPU):

- **The checkpoint as it is read.** transformers memory-maps every safetensors file of the
  checkpoint at once and closes them when the model is loaded. A weight read in its own dtype,
  on the host, with nothing quantized, stays a view of the mapping: nothing is read while
  loading (its pages become resident when the step touches them, counted as parameters then).
  A weight cast to another dtype or quantized is read whole: its pages stay resident while the
  model loads, beside the new tensor (:attr:`~effitrain.results.HostMemory.mapped_bytes` and
  ``weights_bytes``); quantizing also holds working memory (:data:`QUANTIZING_WORKSPACE`).
  Once loaded, effitrain drops the pages of the files still mapped
  (:func:`effitrain.models.release_read_pages`). Reading onto a GPU (``device_map``) leaves
  only the pages read on the host.
- **Who reads it.** One process per launch where the others receive the main process's weights
  (DDP; FSDP2 with ``cpu_ram_efficient_loading``; not a 4-bit load, which every process reads:
  :attr:`effitrain.models.LoadOptions.receives`), each process otherwise
  (:func:`received_bytes`); and **the libraries' resident memory** per process
  (:data:`LIBRARY_BYTES`).
- **On the CPU, the step itself**: the device is the host, so the estimated step's peak tensor
  memory (parameters included) is host memory. **On a GPU, what the step offloads**: the
  offload levers' pinned host copies (offloaded checkpoints, the host optimizer's state), as
  they count them (``Lever.host_step_bytes``).

Not modeled: the allocator's fragmentation and caching, CUDA's libraries and context on a GPU
host, the data pipeline's own memory beyond a small dataset's, and what comes after the last
step (evaluation, saving).

Nothing heavy is imported here: the headers are read as JSON.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.results import CheckpointFacts, HostMemory

if TYPE_CHECKING:
    from effitrain.models import LoadOptions

LIBRARY_BYTES = 600 * 2**20
"""What one ``effitrain train`` process holds besides its tensors: Python, torch, transformers,
accelerate, datasets, peft, the tokenizer and the data pipeline: the peak RSS of a one-step
causal-LM run of the tiny-llama preset (tensors under 10 MiB) on the CPU build of torch
(``benchmarks/loading``'s ``libraries`` row)."""

QUANTIZING_WORKSPACE = 0.3
"""Bytes of working memory per byte of checkpoint read for quantizing: the anonymous memory a
4-bit load holds beyond the weights it makes (transformers' loader threads, bitsandbytes' fp32
copies, the allocator's arenas). Measured: 0.7 GiB for 2.44 GiB quantized, for effitrain's load
and transformers' alike (``benchmarks/loading``, 1.78B parameters); one checkpoint's
measurement, not a law."""

SAFETENSORS_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip
"""torch's names of the dtypes a safetensors header names."""

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
"""Bytes per element of the floating dtypes a checkpoint or ``LoadOptions.dtype`` names."""


def received_bytes(receive: str | None, weights: LandedWeights, processes: int, device: str) -> int:
    """What a process that does not read the checkpoint holds on the host while it gets the main
    process's weights (``receive``: :attr:`effitrain.models.LoadOptions.receives`): under DDP
    (``empty``) its whole model, uninitialized, where the run trains; under FSDP2's
    ``cpu_ram_efficient_loading`` (``meta``) its shard. On a GPU, neither is on the host."""
    if receive is None or device != "cpu":
        return 0
    whole = weights.unquantized_bytes + weights.quantized_bytes
    return whole if receive == "empty" else -(-whole // processes)


# -- the checkpoint, from its headers ----------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets): its first
    8 bytes say how long the JSON that follows is; no tensor is read."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def _from_headers(files: list[Path]) -> CheckpointFacts:
    by_dtype: dict[str, int] = {}
    elements = 0
    for file in files:
        for entry in safetensors_header(file).values():
            start, end = entry["data_offsets"]
            by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + end - start
            elements += math.prod(entry["shape"])
    dominant = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "F32"
    source = "safetensors header" + (f"s of {len(files)} files" if len(files) > 1 else "")
    return CheckpointFacts(
        bytes=sum(by_dtype.values()),
        elements=elements,
        dtype=SAFETENSORS_NAMES.get(dominant, dominant.lower()),
        source=source,
    )


def _cached(name: str, filename: str) -> Path | None:
    """``filename`` of hub id ``name`` in the local hub cache (never the network), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, filename)
    except (ImportError, ValueError):  # no hub client, or not a repo id
        return None
    return Path(found) if isinstance(found, str) else None


def checkpoint_facts(name: str) -> CheckpointFacts | None:
    """The size, element count and dtype of a local folder's or a cached hub id's safetensors
    checkpoint, from the files' headers (never their tensors); with an index whose shards are
    not all there, its ``total_size`` in config.json's dtype. None where there are no
    safetensors to read (a preset, a config.json alone, ``.bin`` weights)."""
    folder = Path(name).expanduser()

    def locate(filename: str) -> Path | None:
        if folder.is_dir():
            path = folder / filename
            return path if path.is_file() else None
        return _cached(name, filename)

    single = locate("model.safetensors")
    if single is not None:
        return _from_headers([single])
    index_path = locate("model.safetensors.index.json")
    if index_path is None:
        return None
    index = json.loads(index_path.read_text())
    shards = [locate(shard) for shard in sorted(set(index.get("weight_map", {}).values()))]
    present = [shard for shard in shards if shard is not None]
    if shards and len(present) == len(shards):
        return _from_headers(present)
    total = (index.get("metadata") or {}).get("total_size")
    if not total:
        return None
    config = locate("config.json")
    dtype = _config_dtype(json.loads(config.read_text()) if config else {})
    return CheckpointFacts(
        bytes=int(total),
        elements=int(total) // DTYPE_BYTES[dtype],
        dtype=dtype,
        source="the safetensors index's total_size, in config.json's dtype",
    )


def _config_dtype(settings: Any) -> str:
    """The dtype a model config (a dict or a transformers config) names; fp32 where none."""
    get = settings.get if isinstance(settings, dict) else lambda key: getattr(settings, key, None)
    dtype = str(get("dtype") or get("torch_dtype") or "float32").removeprefix("torch.")
    return dtype if dtype in DTYPE_BYTES else "float32"


def facts_from_config(model_config: Any, elements: int) -> CheckpointFacts:
    """What a checkpoint of ``elements`` weights in its config's dtype (fp32 where it names
    none) takes on disk: a model known by its config.json alone."""
    dtype = _config_dtype(model_config)
    return CheckpointFacts(
        bytes=elements * DTYPE_BYTES[dtype],
        elements=elements,
        dtype=dtype,
        source="config.json: the parameter count in its dtype",
    )


# -- the model as it lands ---------------------------------------------------------------------


@dataclass(frozen=True)
class LandedWeights:
    """The checkpoint's weights in the model a run builds, as :func:`host_memory` needs them
    (a lever's own parameters, LoRA's adapters, left out)."""

    elements: int
    """Every weight the checkpoint provides (a 4-bit weight counts the weights it stands for)."""
    unquantized_bytes: int = 0
    """The weights kept as tensors of their dtype, in the dtype they train in."""
    quantized_elements: int = 0
    quantized_bytes: int = 0
    """The 4-bit weights' storage (packed codes and quantization state)."""
    largest_quantized: int = 0
    """The elements of the largest weight quantized while reading."""


def landed_weights(model: Any) -> LandedWeights:
    """The facts of a built (or estimated, fake) model's own weights: LoRA's adapters (peft's
    ``lora_`` parameters) are not read from the checkpoint."""
    from effitrain.memory import ledger

    params = [p for name, p in model.named_parameters() if "lora_" not in name]
    quantized = [p for p in params if ledger.is_4bit(p)]
    plain = [p for p in params if not ledger.is_4bit(p)]
    return LandedWeights(
        elements=sum(ledger.logical_numel(p) for p in params),
        unquantized_bytes=ledger.parameter_bytes(plain) if plain else 0,
        quantized_elements=sum(ledger.logical_numel(p) for p in quantized),
        quantized_bytes=ledger.parameter_bytes(quantized) if quantized else 0,
        largest_quantized=max((ledger.logical_numel(p) for p in quantized), default=0),
    )


def host_memory(
    checkpoint: CheckpointFacts | None,
    weights: LandedWeights,
    options: LoadOptions,
    num_processes: int,
    device_type: str,
    step_bytes: int | None,
    receive: str | None = None,
    offloaded_bytes: int = 0,
) -> HostMemory:
    """The host memory one machine needs for a run: each process's libraries, each copy's
    peak while the model loads, and each process's step on the host (on the CPU the step; on a
    GPU what it offloads), whichever is larger.

    Args:
        checkpoint: what is read (None: a preset, built in the dtype it trains in).
        weights: the model as it lands (:func:`landed_weights`).
        options: how the run reads the checkpoint (the levers' ``LoadOptions``, ``onto`` the
            run's device).
        num_processes: processes on the machine.
        device_type: where the step runs (``cpu``: the step is host memory).
        step_bytes: one process's estimated peak tensor memory in a step.
        receive: how the processes other than the main one get their weights (the options'
            ``receives`` on such a process; None: each reads the checkpoint).
        offloaded_bytes: on a GPU, what one process's step holds in host memory (the offload
            levers' pinned copies).
    """
    read = DTYPE_BYTES.get(options.dtype, 4)
    quantized = options.quantization_config is not None and weights.quantized_elements > 0
    q_bytes = weights.quantized_bytes if quantized else 0
    buffer = 4 * weights.largest_quantized if quantized else 0  # its fp32 working copy
    if checkpoint is None:  # random init: built whole in the dtype it trains in, then quantized
        mapped, landed = 0, weights.unquantized_bytes + q_bytes
        landed += weights.quantized_elements * read if quantized else 0
    else:
        per_element = checkpoint.bytes / max(checkpoint.elements, 1)
        cast = DTYPE_BYTES.get(checkpoint.dtype) != read
        # What is converted is read whole; a view of the mapping is read by the step.
        mapped = int(per_element * (weights.elements if cast else weights.quantized_elements))
        landed = q_bytes + (weights.unquantized_bytes if cast else 0)
        buffer += int(QUANTIZING_WORKSPACE * mapped) if quantized else 0
        if options.device_map is not None:  # onto the device as it is read
            mapped, landed, buffer = checkpoint.bytes, 0, 0
    load_peak = mapped + landed + buffer
    copies = 1 if receive else num_processes
    received = received_bytes(receive, weights, num_processes, device_type)
    step = (step_bytes or 0) if device_type == "cpu" else offloaded_bytes
    loading_total = copies * load_peak + (num_processes - copies) * received
    step_total = num_processes * step
    return HostMemory(
        host_peak_bytes=num_processes * LIBRARY_BYTES + max(loading_total, step_total),
        peak_at="the training step" if step_total > loading_total else "loading",
        processes=num_processes,
        copies=copies,
        received_bytes=received,
        library_bytes=LIBRARY_BYTES,
        checkpoint=checkpoint,
        read_dtype=options.dtype + (" (Linear weights 4-bit NF4)" if quantized else ""),
        read_onto="host" if options.device_map is None else device_type,
        mapped_bytes=mapped,
        weights_bytes=landed,
        quantize_buffer_bytes=buffer,
        load_peak_bytes=load_peak,
        step_bytes=step,
    )
