"""``effitrain estimate``: the memory a run will take, before it runs, without the memory.

How: the run's own training step, on fake tensors. Under PyTorch's ``FakeTensorMode`` every tensor
has its shape, dtype and device but no data and no memory, and every operator still runs its real
shape logic, so the same model (built from its config: a preset, a local folder or a hub id's
config, no weights), the same levers (``levers.apply_to_model``), the same optimizer from the
registry and a batch of ``--batch-size`` x ``--max-length`` tokens go through the same forward,
backward, clipping and ``optimizer.step()`` as in :func:`effitrain.loop.train_step`, twice. The
second step is measured by the same :class:`effitrain.memory.step.StepMemoryProbe` that a real
run uses (PyTorch's ``MemTracker``), and parameters, gradients and optimizer state by the same
true-storage ledger (:mod:`effitrain.memory.ledger`, which counts fake storages by their size). So the
estimate is not a model of memory: it is the measurement, made on tensors that do not exist.

What it cannot know: values. Where an optimizer reads a number back from a tensor (``.item()``:
step counts, norms), it gets 1; that can change a value, never a shape, so no state size. Peak
RSS (libraries, the allocator) is not estimated; on CUDA the allocator's rounding and
workspaces are not either (the tracker's total is what ``max_memory_allocated`` would be,
less those).

Assumes every batch is full: ``--max-length`` tokens per example (a real run pads each batch to
its longest example, so short texts take less).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.memory import ledger

STEPS = 2
"""Optimizer steps run; the last is measured (the first creates the optimizer state)."""


def _fake_mode() -> Any:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    class EstimateMode(FakeTensorMode):
        """Fake tensors that answer ``.item()`` with 1 (True for bool): optimizers read step
        counts and norms back; their state's shapes never depend on those values."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                dtype = args[0].dtype
                if dtype == torch.bool:
                    return True
                return 1.0 if (dtype.is_floating_point or dtype.is_complex) else 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    return EstimateMode(allow_non_fake_inputs=True)


@contextmanager
def _without_compiled_update() -> Iterator[None]:
    """torchao's step allocates its state (its own ``_new_buffer``: the quantize-or-not rule,
    the tensor subclasses) and then calls ``torch.compile(single_param_adam)(...)``: here that
    call does nothing, so the state is torchao's and the update is skipped."""
    from unittest import mock

    import torch

    with mock.patch.object(torch, "compile", lambda *_args, **_kwargs: lambda *_a, **_k: None):
        yield


@contextmanager
def _cannot_trace(optim: str) -> Iterator[None]:
    """An operator without a fake (shape-only) implementation: one line, not a traceback."""
    try:
        yield
    except EffitrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything fake tensors cannot run
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise EffitrainError(
            f"cannot estimate --optim {optim} on fake tensors ({type(exc).__name__}: {first}); "
            "measure it instead: effitrain train --max-steps 2 with the same options"
        ) from exc


def _materialize(model: Any, device: Any) -> None:
    """Give every meta parameter and buffer a fake tensor of its shape and dtype on ``device``
    (inside the fake mode); a tensor shared by several modules (tied weights) stays shared."""
    import torch

    made: dict[int, Any] = {}

    def fake(t: Any, parameter: bool) -> Any:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            if ledger.is_4bit(t):  # --load-in-4bit: bitsandbytes quantizes the fake weight
                from effitrain.quantize import quantized_like

                made[id(t)] = quantized_like(t, new)
            elif parameter:
                made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            else:
                made[id(t)] = new
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = fake(param, parameter=True)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fake(buffer, parameter=False)


def estimate(config: TrainConfig, num_processes: int = 1, sharding: str = "ddp") -> dict[str, Any]:
    """What ``effitrain train`` with ``config`` would measure, with the metrics JSON's field
    names (``optimizer_state``, ``parameter_bytes``, ``gradient_bytes``, ``activation_bytes``,
    ``peak_tensor_bytes`` …), plus ``estimate`` (how it was made) and ``notes``; with
    ``num_processes`` > 1, also ``per_device``: each process's share under ``sharding``
    (:func:`per_device`).

    Raises:
        EffitrainError: the model, the data or the options cannot be used, or the optimizer
            cannot run under ``sharding`` (the same refusal as ``effitrain train``'s).
    """
    import torch

    import effitrain.levers as levers
    import effitrain.tasks as tasks
    from effitrain import optim
    from effitrain.activation_offload import HostBytes
    from effitrain.optim import bf16, resolve_hyperparameters, set_train_mode

    notes = _checked(config, num_processes, sharding)
    task = tasks.resolve_task(config)
    # A causal LM needs no labels from the data: its shapes come from the model alone.
    data = task.load_data(config) if task.name != tasks.CAUSAL_LM else None
    tokenizer, max_tokens = _tokenizer_or_config(config, notes)
    spec = bf16.optimizer_spec(config)
    lr = resolve_hyperparameters(config).lr
    device = torch.device("cpu")
    torch.manual_seed(config.seed)
    # Built on the meta device (shapes only; module conversions such as the bf16 cast work
    # there, not on fake parameters), then given fake storage on the run's device.
    with torch.device("meta"):
        model = task.model_from_config(config, data, tokenizer)
        model = levers.apply_to_model(model, config)
    spec = optim.for_sharding(spec, num_processes > 1 and sharding == "fsdp")
    loss = task.loss_function(config, model, device, None)
    if spec.module == "torchao":
        from effitrain.optim.low_bit import build_quantization_maps

        build_quantization_maps()  # cached for the process: never from fake values
    with _fake_mode():
        _materialize(model, device)
        model.train()
        optimizer = _optimizer(config, model, spec, lr)
        set_train_mode(optimizer, True)  # as fit() does (schedule-free)
        # As the tasks tokenize (classification.tokenize, lm_data.tokenize_lm): capped by the
        # tokenizer's model_max_length (without a tokenizer, by the model's positions).
        length = min(config.max_length, max_tokens)
        batch = task.fake_batch(tokenizer, config.batch_size, length)
        notes += _offload_notes(config, spec)
        host_bytes = HostBytes() if config.activation_offload else None
        step_memory = _train_steps(config, spec, model, optimizer, batch, device, loss, host_bytes)
        result = _measured(config, spec, lr, model, optimizer, step_memory)
        result.update(_offloaded(optimizer, host_bytes))
        result["loss"] = loss.to_dict()
        result["levers"] += loss.levers
        if num_processes > 1:
            layout = fsdp2_layout(model, optimizer) if sharding == "fsdp" else None
            result["per_device"] = per_device(result, num_processes, sharding, layout)
        if config.optimizer_in_backward:
            optimizer.remove_hooks()
    result["estimate"] = {
        "method": "fake tensors (torch FakeTensorMode) through the real training step",
        "model": config.model,
        "batch_size": config.batch_size,
        "max_length": length,
        "grad_accum": config.grad_accum,
        "mixed_precision": config.mixed_precision,
        "measured_step": STEPS,
    }
    result["notes"] = notes
    return result


def _checked(config: TrainConfig, num_processes: int, sharding: str) -> list[str]:
    """Refuse what ``effitrain train`` would refuse (and fp16); its notes on the sharding."""
    from effitrain.build import check_config
    from effitrain.optim import bf16

    check_config(config)
    notes = []
    if num_processes > 1:
        notes += sharding_notes(bf16.optimizer_spec(config).name, num_processes, sharding)
    if config.mixed_precision == "fp16":
        raise EffitrainError(
            "effitrain estimate does not model fp16 loss scaling; use --mixed-precision bf16 or no"
        )
    return notes


def _optimizer(config: TrainConfig, model: Any, spec: Any, lr: float) -> Any:
    """The run's optimizer; with --optimizer-offload, its stand-in (torchao needs CUDA)."""
    from effitrain.build import configured_optimizer

    if config.optimizer_offload == "off":
        return configured_optimizer(config, model, spec, lr)
    from effitrain.optim import param_groups
    from effitrain.optim.offload import EstimatedOffload

    groups = param_groups(model, config.weight_decay)
    return EstimatedOffload(groups, spec.factory, lr, config.optimizer_offload == "state+grads")


def _offload_notes(config: TrainConfig, spec: Any) -> list[str]:
    """What the estimate of a torchao optimizer or an offload lever leaves out."""
    notes = []
    if spec.module == "torchao":
        notes.append(
            f"{spec.name}: torchao's own state allocation was run, not its compiled update "
            "(torch.compile cannot run on fake tensors): the update's working tensors are "
            "not in the peak"
        )
    if config.activation_offload:
        notes.append(
            "--activation-offload: trl's choice of what moves is modeled (not parameters, not "
            "under 1 KiB, not the output head's inputs, each storage once), moved at once: its "
            "copies in flight (up to 5 behind compute) are not"
        )
    if config.optimizer_offload != "off":
        notes.append(
            "--optimizer-offload: the host optimizers run on fake copies after the measured "
            "step (their state and copies are host memory, not in the peak)"
        )
    return notes


def _offloaded(optimizer: Any, host_bytes: Any) -> dict[str, Any]:
    """The offload levers' fields (as ``levers.offload_results``): the optimizer's state where
    it lives (``optimizer_state`` becomes the total, host included), the activations' host
    bytes."""
    from effitrain.optim.offload import EstimatedOffload

    fields: dict[str, Any] = {}
    if host_bytes is not None:
        fields["activation_offload_host_bytes"] = host_bytes.peak
    if isinstance(optimizer, EstimatedOffload):
        fields["optimizer_offload"], states = optimizer.where()
        fields["optimizer_state"] = ledger.optimizer_state_ledger(states).to_dict()
    return fields


def _tokenizer_or_config(config: TrainConfig, notes: list[str]) -> tuple[Any, int]:
    """The run's tokenizer and the longest sequence it makes; or, for a hub id or folder that
    has a config.json and no tokenizer, None and the longest sequence the model's positions
    allow (shapes need no tokenizer; a note says how the batch is made).

    Raises:
        EffitrainError: neither a tokenizer nor a model config can be read.
    """
    from effitrain.models import load_model_config, load_tokenizer, max_positions

    try:
        tokenizer = load_tokenizer(config.model)
    except EffitrainError:
        model_config = load_model_config(config.model)  # its one-line error where none either
    else:
        return tokenizer, tokenizer.model_max_length
    positions = max_positions(model_config)
    length = min(config.max_length, positions or config.max_length)
    vocabulary = getattr(model_config, "vocab_size", None)
    notes.append(
        f"no tokenizer found for '{config.model}': the batch is {config.batch_size} x {length} "
        "token ids made from its config.json"
        + (f" (vocabulary {vocabulary:,})" if vocabulary else "")
        + (f", at most max_position_embeddings ({positions:,}) long" if positions else "")
    )
    return None, positions or config.max_length


def _train_steps(
    config: TrainConfig,
    spec: Any,
    model: Any,
    optimizer: Any,
    batch: dict[str, Any],
    device: Any,
    loss_function: Any,
    host_bytes: Any = None,
) -> dict[str, Any]:
    """The run's training step, ``STEPS`` times on fake tensors; the last one is measured as
    ``effitrain train`` measures its tracked step. Returns the probe's step memory.
    ``host_bytes``: --activation-offload, modeled (``activation_offload.fake_offload``)."""
    import torch

    from effitrain.activation_offload import fake_offload
    from effitrain.memory.step import StepMemoryProbe
    from effitrain.tasks.lm_loss import labelled_tokens

    autocast_bf16 = config.mixed_precision == "bf16"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    step_memory: dict[str, Any] = {}
    with (
        StepMemoryProbe(model, optimizer, device, compiled_step=False) as probe,
        _cannot_trace(spec.name),
        _without_compiled_update() if spec.module == "torchao" else nullcontext(),
    ):
        for step in range(STEPS):
            if step == STEPS - 1:
                probe.start()
            for micro in range(config.grad_accum):
                if micro:
                    probe.next_micro_batch()
                with fake_offload(model, host_bytes) if host_bytes is not None else nullcontext():
                    with autocast:
                        loss = loss_function(model, batch)
                    if loss_function.token_weighted:  # a sum: over the step's tokens, as in a run
                        loss = loss / (labelled_tokens(batch) * config.grad_accum)
                    loss.backward()
            if config.effective_max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.effective_max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == STEPS - 1:
                step_memory = probe.stop()
    return step_memory


SHARDED = {
    "ddp": (),
    "zero1": ("optimizer_state",),
    "zero2": ("optimizer_state", "gradients"),
    "zero3": ("optimizer_state", "gradients", "parameters"),
    "fsdp": ("optimizer_state", "gradients", "parameters"),
}
"""What each strategy splits across processes (``fsdp`` is FSDP2 full shard, like ZeRO-3)."""


def check_sharding(sharding: str) -> None:
    """Refuse an unknown ``--sharding`` in one line.

    Raises:
        EffitrainError: ``sharding`` is not one of :data:`SHARDED`.
    """
    if sharding not in SHARDED:
        raise EffitrainError(
            f"unknown --sharding '{sharding}'; choose one of: {', '.join(SHARDED)}"
        )


def sharding_notes(optim: str, num_processes: int, sharding: str) -> list[str]:
    """What ``effitrain train`` would say about ``optim`` under ``sharding`` over
    ``num_processes`` processes (``distributed.optimizer_notes`` on a stand-in of Accelerate's
    state): notes, or the refusal raised.

    Raises:
        EffitrainError: an unknown strategy, or the optimizer is refused under it.
    """
    from types import SimpleNamespace

    from effitrain.distributed import optimizer_notes

    check_sharding(sharding)
    if sharding == "ddp":
        return []
    if sharding == "fsdp":
        plugin = SimpleNamespace(fsdp_version=2, reshard_after_forward=True)
        state = SimpleNamespace(
            distributed_type="FSDP", num_processes=num_processes, fsdp_plugin=plugin
        )
    else:
        plugin = SimpleNamespace(zero_stage=int(sharding[-1]), deepspeed_config={})
        state = SimpleNamespace(
            distributed_type="DEEPSPEED", num_processes=num_processes, deepspeed_plugin=plugin
        )
    return optimizer_notes(state, optim)


def _rank0_rows(rows: int, n: int) -> int:
    """Rows of a dim 0 of ``rows`` that FSDP2 gives rank 0, the largest share (torch.chunk)."""
    return min(rows, -(-rows // n))


def fsdp2_layout(model: Any, optimizer: Any) -> dict[str, dict[str, int]]:
    """How FSDP2 splits this run's tensors: per kind (``parameters``, ``gradients``,
    ``optimizer_state``), bytes by the size of the dim 0 they are split on (``"rows:<n>"``) and
    the bytes every rank holds whole (``"whole"``: the column factors of 2-D weights, scalars).
    Gradients are the trainable parameters' shapes."""
    import torch

    from effitrain.distributed import replicated_under_fsdp2

    layout: dict[str, dict[str, int]] = {"parameters": {}, "gradients": {}, "optimizer_state": {}}

    def add(kind: str, tensor: Any, whole: bool = False) -> None:
        nbytes = ledger.optimizer_state_ledger({0: {"t": tensor}}).bytes
        key = "whole" if whole or tensor.dim() == 0 else f"rows:{tensor.shape[0]}"
        layout[kind][key] = layout[kind].get(key, 0) + nbytes

    state = ledger.unwrap_optimizer(optimizer).state
    for p in model.parameters():
        add("parameters", p)
        if p.requires_grad:
            add("gradients", p)
        for key, value in state.get(p, {}).items():
            if torch.is_tensor(value):
                add("optimizer_state", value, replicated_under_fsdp2(key, p.dim()))
    whole = ledger.optimizer_state_ledger(optimizer).bytes - sum(layout["optimizer_state"].values())
    layout["optimizer_state"]["whole"] = layout["optimizer_state"].get("whole", 0) + whole
    return layout


def _fsdp2_share(split: dict[str, int], n: int) -> int:
    total = 0
    for key, nbytes in split.items():
        if key == "whole":
            total += nbytes
        else:
            rows = int(key.removeprefix("rows:"))
            total += nbytes * _rank0_rows(rows, n) // rows
    return total


def per_device(
    result: dict[str, Any],
    num_processes: int,
    sharding: str,
    fsdp2: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """Each process's share under ``sharding`` over ``num_processes`` processes, from a
    one-process estimate: the sharded parts divided by N (rounded up), the rest (activations:
    each process runs its own --batch-size; temporaries) whole. The peak is the one-process
    peak's composition with the sharded parts divided.

    With ``fsdp2`` (:func:`fsdp2_layout`), FSDP2's split tensor by tensor: rank 0's rows of each
    dim 0 (the largest share when rows do not divide), and whole what every rank holds whole
    (the factored optimizers' column factors of 2-D weights).

    A model of the split, not a measurement: FSDP's all-gathered layer (the largest one's full
    parameters, briefly) and the communication buckets (DDP keeps a gradient-sized set unless
    ``gradient_as_bucket_view``) are not included.

    Raises:
        EffitrainError: an unknown strategy.
    """
    check_sharding(sharding)
    split = SHARDED[sharding]
    n = max(num_processes, 1)
    totals = {
        "parameters": result["parameter_bytes"],
        "gradients": result["gradient_bytes"],
        "optimizer_state": result["optimizer_state"]["bytes"],
    }
    flat = _flat_factored_state(result, sharding)

    def share(kind: str, value: int | None) -> int | None:
        if value is None or kind not in split:
            return value
        if kind == "optimizer_state" and flat is not None and totals[kind]:
            return -(-value * flat // (totals[kind] * n))  # the same parts, unfactored
        if fsdp2 is None or not totals.get(kind):
            return -(-value // n)
        # the measured bytes (gradients: as the tracker saw them) in the layout's proportions
        layout_total = sum(fsdp2[kind].values())
        return -(-value * _fsdp2_share(fsdp2[kind], n) // layout_total) if layout_total else 0

    at_peak = result.get("step_memory", {}).get("at_peak", {})
    peak = sum(share(kind, value) or 0 for kind, value in at_peak.items())
    return {
        "num_processes": n,
        "sharding": sharding,
        "parameter_bytes": share("parameters", result["parameter_bytes"]),
        "gradient_bytes": share("gradients", result["gradient_bytes"]),
        "optimizer_state_bytes": share("optimizer_state", result["optimizer_state"]["bytes"]),
        "activation_bytes": result["activation_bytes"],
        "peak_tensor_bytes": peak if at_peak else None,
        "modeled": (
            "FSDP2's split, tensor by tensor (rank 0's rows; replicated factors whole)"
            if fsdp2 is not None
            else "sharded parts divided by the number of processes"
            + ("; flat partitions: a full second moment, unfactored" if flat is not None else "")
        ),
    }


def _flat_factored_state(result: dict[str, Any], sharding: str) -> int | None:
    """A factored optimizer's state on DeepSpeed ZeRO's flat 1-D partitions, where it cannot
    factor: a full second moment, 4 bytes per trainable parameter (CAME: 8, with its exp_avg;
    docs/distributed.md), as one process would hold it. None where it factors."""
    from effitrain.distributed import FACTORED_OPTIMIZERS

    if not sharding.startswith("zero") or result.get("optimizer") not in FACTORED_OPTIMIZERS:
        return None
    per_parameter = 8 if result["optimizer"] == "came" else 4
    return int(result.get("trainable_parameters", 0)) * per_parameter


def _measured(
    config: TrainConfig,
    spec: Any,
    lr: float,
    model: Any,
    optimizer: Any,
    step_memory: dict[str, Any],
) -> dict[str, Any]:
    """What a run's metrics JSON would say (the same fields, computed the same way as
    ``effitrain.training`` does), from the fake model and optimizer after the measured step."""
    import effitrain.levers as levers

    kind_peaks = step_memory.get("kind_peaks", {})
    return {
        "optimizer": spec.name,
        "optimizer_class": spec.class_path,
        "lr": lr,
        "optimizer_state": ledger.optimizer_state_ledger(optimizer).to_dict(),
        "parameter_bytes": ledger.parameter_bytes(model),
        "trainable_parameters": ledger.trainable_parameter_count(model),
        "trainable_parameter_bytes": ledger.trainable_parameter_bytes(model),
        "gradient_bytes": kind_peaks.get("gradients", 0),
        "adamw_equivalent_bytes": ledger.adamw_equivalent_bytes(model),
        "adamw_equivalent_elements": ledger.adamw_equivalent_elements(model),
        "activation_bytes": kind_peaks.get("activations"),
        "peak_tensor_bytes": step_memory.get("peak_tensor_bytes"),
        "step_memory": step_memory,
        "levers": levers.active(config),
        "quantized_weights": levers.quantized_weights(config, model),
        "baseline": ledger.fp32_adamw_baseline(levers.original_parameters(model)),
    }
