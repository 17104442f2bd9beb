"""``effitrain estimate``: the memory a run will take, before it runs, without the memory.

How: the run itself, on fake tensors. Under PyTorch's ``FakeTensorMode`` every tensor has its
shape, dtype and device but no data and no memory, and every operator still runs its real shape
logic. The run is built by :mod:`effitrain.build`'s own functions (the model from its config, on
the meta device, with the same levers; the same optimizer spec, optimizer, scheduler and
``accelerator.prepare``) and a batch of ``--batch-size`` x ``--max-length`` tokens goes through
the loop's own :func:`effitrain.loop.train_steps` (forward, ``accelerator.backward``, clipping,
the guard, ``optimizer.step()``), twice. The second step is measured by the same
:class:`effitrain.memory.step.StepMemoryProbe` that a real run uses, and the result is summed up
by the same :func:`effitrain.measure.memory_record`. So the estimate is not a model of memory: it
is the measurement, made on tensors that do not exist. A loss that generates before the step's
first forward (GRPO) generates here too, with its own code, from a fake batch of prompts
(the task's :meth:`~effitrain.tasks.base.Task.estimate_shape`), and the probe measures that
generation as the step's generation phase.

What only a real launch has is stood in for: the data (one fake batch, every example full
length), the processes (the estimate describes the launch it is told about, ``--num-processes``,
``--sharding``, ``--device``, and splits its one-process measurement as that launch would), and
the machine (the fake tensors live on the CPU, with the run's own Accelerator made there, apart
from this process's Accelerate state).

What it cannot know: values. Where an optimizer reads a number back from a tensor (``.item()``:
step counts, norms), it gets 1; that can change a value, never a shape, so no state size. Peak
RSS is modeled beside it, not measured (:mod:`effitrain.memory.host`: ``host_peak_bytes``); on
CUDA the allocator's rounding and workspaces are not estimated (the tracker's total is what
``max_memory_allocated`` would be, less those).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import effitrain.build as build
import effitrain.levers as levers
import effitrain.levers.context_parallel as context_parallel
from effitrain.config import TrainConfig
from effitrain.distributed import Launch
from effitrain.errors import EffitrainError
from effitrain.loop import StepGuard, train_steps
from effitrain.measure import memory_record
from effitrain.memory import host, ledger
from effitrain.memory.step import StepMemoryProbe
from effitrain.progress import TrainingProgress
from effitrain.results import Estimate, EstimateSettings, HostMemory, MemoryRecord, PerDevice
from effitrain.run import Plan
from effitrain.signals import StopRequest
from effitrain.tasks.lm_data import packs
from effitrain.tracking import Trackers

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from effitrain.optim import OptimizerSpec
    from effitrain.parts import Loss
    from effitrain.run import Run
    from effitrain.tasks.base import Task

STEPS = 2
"""Optimizer steps run; the last is measured (the first creates the optimizer state)."""


def steps_run(config: TrainConfig) -> int:
    """The optimizer steps the estimate runs: :data:`STEPS`, or under GRPO's
    ``--num-iterations`` N, N + 1: the last is then the first step after the first that
    generates (the ones between train on earlier completions, with no generation phase)."""
    return STEPS - 1 + config.num_iterations


def _fake_mode() -> Any:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    class EstimateMode(FakeTensorMode):
        """Fake tensors that answer ``.item()`` with 1 (True for bool): optimizers read step
        counts and norms back; their state's shapes never depend on those values."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


def _materialize(model: torch.nn.Module, device: torch.device | None, config: TrainConfig) -> None:
    """Give every meta parameter and buffer a fake tensor of its shape and dtype on ``device``
    (inside the fake mode), or what a lever makes of it (4-bit weights: quantized by
    bitsandbytes' own shape logic); a tensor shared by several modules (tied weights) stays
    shared."""
    import torch

    made: dict[int, Any] = {}

    def fake(t: Any, parameter: bool) -> Any:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            by_lever = levers.fake_tensor(config, t, new)
            if by_lever is not None:
                made[id(t)] = by_lever
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


@contextmanager
def _own_accelerate_state() -> Iterator[None]:
    """The estimate's Accelerator gets Accelerate's process-wide state to itself (on the CPU,
    with the estimated run's mixed precision); this process's own state is put back after."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState)]
    saved.append((GradientState, dict(GradientState._shared_state)))
    for cls, _ in saved:
        cls._shared_state.clear()
    try:
        yield
    finally:
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


class _FakeLoader(list):
    """The training data of an estimate: the same fake batch, one optimizer step's worth per
    step (a stand-in for the DataLoader, which only a real launch has)."""


def estimate(config: TrainConfig, launch: Launch | None = None) -> Estimate:
    """What ``effitrain train`` with ``config`` would measure on ``launch`` (default: one
    process on the CPU): the same fields as its metrics JSON, how the estimate was made, its
    notes, and, over several processes, each process's share (:func:`per_device`).

    Raises:
        EffitrainError: the model, the data or the options cannot be used, or the launch
            rules them out (the same refusals as ``effitrain train``'s).
    """
    import torch

    launch = launch or Launch.described(1, "ddp", "cpu")
    notes = _checked(config, launch)
    task = build.resolve_task(config)
    data = task.load_data(config) if task.estimate_reads_data(config) else None
    tokenizer, max_tokens = _tokenizer_or_config(config, notes, task)
    spec = build.resolve_optimizer_spec(config, launch)
    notes += levers.estimate_notes(config) + _optimizer_notes(spec)
    if launch.device_type != "cpu":
        notes.append(
            f"estimated for {launch.device_type}, on fake tensors on this machine's CPU: the "
            "device's own workspaces and allocator rounding are not in the peak"
        )
    device = torch.device("cpu")  # where the fake tensors live
    torch.manual_seed(config.seed)
    # Built on the meta device (shapes only; module conversions such as the bf16 cast work
    # there, not on fake parameters), then given fake storage.
    with torch.device("meta"):
        model = build.build_model(config, task, data, tokenizer, device=None, loaded=False)
    loss = build.build_loss(config, task, model, launch, device)
    if spec.module == "torchao":
        from effitrain.optim.low_bit import build_quantization_maps

        build_quantization_maps()  # cached for the process: never from fake values
    # As the tasks tokenize (classification.tokenize, lm_data.tokenize_lm): capped by the
    # tokenizer's model_max_length (without a tokenizer, by the model's positions).
    rows, length = task.estimate_shape(config, data, tokenizer, min(config.max_length, max_tokens))
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    # Collated outside the fake mode, as the run's collator does it: its host-side facts (where
    # each row's documents lie) come from the token tensors' values, which fakes do not have.
    # One rank's share of each sequence: --context-parallel's ranks each hold L/N tokens.
    rank_length = context_parallel.rank_length(config, length)
    collated = task.fake_batch(tokenizer, rows, rank_length, packed=packs(config, model_type))
    with ExitStack() as scope:
        scope.enter_context(_own_accelerate_state())
        scope.enter_context(_fake_mode())
        scope.enter_context(_cannot_trace(spec.name))
        if spec.module == "torchao":
            scope.enter_context(_without_compiled_update())
        _materialize(model, device, config)
        landed = host.landed_weights(model)
        # Its tensors made again inside the mode: the step's memory holds them, as the run's.
        batch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in collated.items()}
        run = _fake_run(config, launch, task, data, tokenizer, model, loss, batch)
        progress = _run_steps(run, device)
        levers.finish_steps(run)
        memory = memory_record(run, progress)
        per = None
        if launch.num_processes > 1:
            layout = fsdp2_layout(run.model, run.optimizer) if launch.strategy == "fsdp" else None
            per = per_device(memory, spec.name, launch.num_processes, launch.strategy, layout)
    step = (per or memory).peak_tensor_bytes
    return Estimate(
        optimizer=spec.name,
        optimizer_class=spec.class_path,
        lr=run.hyperparameters.lr,
        memory=memory,
        settings=_settings(config, length, len(batch["input_ids"]) // rows),
        per_device=per,
        notes=notes,
        cost=progress.step_cost,
        host=_host_memory(config, model, landed, launch, step, memory.lever_fields),
    )


def _fake_run(
    config: TrainConfig,
    launch: Launch,
    task: Task,
    data: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    model: torch.nn.Module,
    loss: Loss,
    batch: dict[str, Any],
) -> Run:
    """The run as ``build.assemble`` makes a real one, on a CPU accelerator, with ``batch`` as
    every micro-batch of :func:`steps_run` optimizer steps (inside the fake mode)."""
    steps = steps_run(config)
    return build.assemble(
        config=config,
        accelerator=build.build_accelerator(config, cpu=True),
        launch=launch,
        task=task,
        data=data,
        tokenizer=tokenizer,
        model=model,
        loss=loss,
        # The loop only iterates the training data; nothing reads the evaluation's.
        train_loader=cast("DataLoader[Any]", _FakeLoader([batch] * (config.grad_accum * steps))),
        eval_loader=cast("DataLoader[Any]", _FakeLoader()),
        plan=Plan(steps, steps, 1, 0, generation_period=config.num_iterations),
        trackers=Trackers(None, config),
        estimating=True,
    )


def _settings(config: TrainConfig, length: int, sequences: int) -> EstimateSettings:
    """The batch the estimate assumed (``sequences`` per example: 2 for preference pairs)."""
    return EstimateSettings(
        model=config.model,
        batch_size=config.batch_size,
        max_length=length,
        grad_accum=config.grad_accum,
        mixed_precision=config.mixed_precision,
        measured_step=steps_run(config),
        sequences_per_example=sequences,
    )


def _checked(config: TrainConfig, launch: Launch) -> list[str]:
    """``train``'s checks of the options and the launch, and what estimate cannot model; the
    launch's notes."""
    build.check_config(config)
    notes = build.check_launch(config, launch)
    if config.mixed_precision == "fp16":
        raise EffitrainError(
            "effitrain estimate does not model fp16 loss scaling; use --mixed-precision bf16 or no"
        )
    return notes


def _host_memory(
    config: TrainConfig,
    model: torch.nn.Module,
    landed: host.LandedWeights,
    launch: Launch,
    step: int | None,
    lever_fields: dict[str, Any],
) -> HostMemory:
    """The host memory of one machine (:mod:`effitrain.memory.host`): the checkpoint read as
    the run reads it (the facts from its safetensors headers; for a config alone, its parameter
    count in the config's dtype; a preset reads none), and what the levers offload to the host
    (from their metrics fields, ``lever_fields``)."""
    import torch

    from effitrain.models import LoadOptions, base_model, is_preset

    checkpoint = None
    if not is_preset(config.model):
        checkpoint = host.checkpoint_facts(config.model) or host.facts_from_config(
            base_model(model).config, landed.elements
        )
    options = levers.load_options(config, LoadOptions()).onto(torch.device(launch.device_type))
    receive = None
    if launch.num_processes > 1:  # how a process other than the main one would get them
        other = SimpleNamespace(**{**vars(launch.state), "process_index": 1})
        wanted = dataclasses.replace(launch, state=other).receives_weights
        receive = dataclasses.replace(options, receive=wanted).receives
    return host.host_memory(
        checkpoint,
        landed,
        options,
        launch.num_processes,
        launch.device_type,
        step,
        receive,
        offloaded_bytes=levers.host_step_bytes(config, lever_fields),
    )


def _run_steps(run: Run, device: torch.device | None) -> TrainingProgress:
    """The estimate's :func:`steps_run` optimizer steps through the loop's own ``train_steps``, the
    last measured by the step probe a run uses (the update of a torch.compile'd torchao step
    skipped: :func:`_without_compiled_update`). Returns the loop's progress, which holds the
    measured step."""
    from effitrain.optim import set_train_mode

    progress = TrainingProgress.for_accelerator(run.accelerator)
    guard = StepGuard(run.accelerator, StopRequest(), None, levers.updates_in_backward(run.config))
    run.model.train()
    set_train_mode(run.optimizer, True)  # as fit() does (schedule-free)
    extra = run.loss.step_tensors()
    with StepMemoryProbe(
        run.model, run.optimizer, device, compiled_step=False, extra=extra
    ) as probe:
        for _ in train_steps(run, run.train_loader, progress, guard, probe):
            pass
    return progress


def _optimizer_notes(spec: OptimizerSpec) -> list[str]:
    """What the estimate of the optimizer's own step leaves out."""
    if spec.module != "torchao":
        return []
    return [
        f"{spec.name}: torchao's own state allocation was run, not its compiled update "
        "(torch.compile cannot run on fake tensors): the update's working tensors are not in "
        "the peak"
    ]


LONGEST_TRIED = 2**24
"""A length past any context trained today: where nothing caps a run's sequences, the plan's
search for the longest stops here."""


def sequence_cap(config: TrainConfig) -> int:
    """The longest sequence a run of ``config`` takes (and its estimate): its tokenizer's
    model_max_length, else the model's positions, at most :data:`LONGEST_TRIED`.

    Raises:
        EffitrainError: neither a tokenizer nor a model config can be read.
    """
    return _tokenizer_or_config(dataclasses.replace(config, max_length=LONGEST_TRIED), [])[1]


def _tokenizer_or_config(
    config: TrainConfig, notes: list[str], task: Task | None = None
) -> tuple[Any, int]:
    """The run's tokenizer and the longest sequence it makes; or, for a hub id or folder that
    has a config.json and no tokenizer, None and the longest sequence the model's positions
    allow (shapes need no tokenizer; a note says how ``task``'s batch is made, where one is
    given).

    Raises:
        EffitrainError: neither a tokenizer nor a model config can be read.
    """
    from effitrain.models import (
        capped_length,
        load_model_config,
        load_tokenizer,
        max_positions,
        sequence_limit,
    )

    def limit(positions: int) -> int:
        return sequence_limit(config.model, positions, config.max_length, config.beyond_positions)

    try:
        tokenizer = load_tokenizer(config.model)
    except EffitrainError:
        model_config = load_model_config(config.model)  # its one-line error where none either
    else:
        return tokenizer, capped_length(config.max_length, limit(tokenizer.model_max_length), notes)
    positions = max_positions(model_config)
    positions = limit(positions) if positions else None
    if task is None:  # sequence_cap's: the length alone
        return None, positions or config.max_length
    length = min(config.max_length, positions or config.max_length)
    vocabulary = getattr(model_config, "vocab_size", None)
    notes.append(
        f"no tokenizer found for '{config.model}': the batch is "
        f"{task.estimate_batch(config, length)} made from its config.json"
        + (f" (vocabulary {vocabulary:,})" if vocabulary else "")
        + (
            f", at most max_position_embeddings ({positions:,}) long"
            if positions and not config.beyond_positions
            else ""
        )
    )
    return None, positions or config.max_length


def _rank0_rows(rows: int, n: int) -> int:
    """Rows of a dim 0 of ``rows`` that FSDP2 gives rank 0, the largest share (torch.chunk)."""
    return min(rows, -(-rows // n))


def fsdp2_layout(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, dict[str, int]]:
    """How FSDP2 splits this run's tensors: per kind (``parameters``, ``gradients``,
    ``optimizer_state``), bytes by the size of the dim 0 they are split on (``"rows:<n>"``) and
    the bytes every rank holds whole (``"whole"``: the column factors of 2-D weights, scalars,
    a 4-bit weight's quant state). Gradients are the trainable parameters' shapes. A 4-bit
    weight's packed codes are split as FSDP2 splits them: stored as 2-byte elements in one
    column (:data:`effitrain.levers.qlora_bnb.SHARDABLE_STORAGE`)."""
    import torch

    from effitrain.distributed import replicated_under_fsdp2

    layout: dict[str, dict[str, int]] = {"parameters": {}, "gradients": {}, "optimizer_state": {}}

    def add(kind: str, tensor: Any, whole: bool = False, rows: int | None = None) -> None:
        nbytes = ledger.optimizer_state_ledger({0: {"t": tensor}}).bytes
        rows = tensor.shape[0] if rows is None and tensor.dim() else rows
        key = "whole" if whole or not rows else f"rows:{rows}"
        layout[kind][key] = layout[kind].get(key, 0) + nbytes

    state = ledger.unwrap_optimizer(optimizer).state
    for p in model.parameters():
        if ledger.is_4bit(p):
            codes = p.as_subclass(torch.Tensor)
            add("parameters", codes, rows=codes.numel() * codes.element_size() // 2)
            for tensor in ledger.quant_state_tensors(p):
                add("parameters", tensor, whole=True)
        else:
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


SHARDED = {
    "ddp": (),
    "zero1": ("optimizer_state",),
    "zero2": ("optimizer_state", "gradients"),
    "zero3": ("optimizer_state", "gradients", "parameters"),
    "fsdp": ("optimizer_state", "gradients", "parameters"),
}
"""What each strategy splits across processes (``fsdp`` is FSDP2 full shard, like ZeRO-3)."""


def per_device(
    memory: MemoryRecord,
    optimizer: str,
    num_processes: int,
    sharding: str,
    fsdp2: dict[str, dict[str, int]] | None = None,
) -> PerDevice:
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
    """
    split = SHARDED[sharding]
    n = max(num_processes, 1)
    totals = {
        "parameters": memory.parameter_bytes,
        "gradients": memory.gradient_bytes,
        "optimizer_state": memory.optimizer_state.bytes,
    }
    flat = _flat_factored_state(memory, optimizer, sharding)

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

    at_peak = memory.step_memory.at_peak if memory.step_memory else {}
    peak = sum(share(kind, value) or 0 for kind, value in at_peak.items())
    return PerDevice(
        num_processes=n,
        sharding=sharding,
        parameter_bytes=share("parameters", memory.parameter_bytes) or 0,
        gradient_bytes=share("gradients", memory.gradient_bytes) or 0,
        optimizer_state_bytes=share("optimizer_state", memory.optimizer_state.bytes) or 0,
        activation_bytes=memory.activation_bytes,
        peak_tensor_bytes=peak if at_peak else None,
        modeled=(
            "FSDP2's split, tensor by tensor (rank 0's rows; replicated factors whole)"
            if fsdp2 is not None
            else "sharded parts divided by the number of processes"
            + ("; flat partitions: a full second moment, unfactored" if flat is not None else "")
        ),
    )


def _flat_factored_state(memory: MemoryRecord, optimizer: str, sharding: str) -> int | None:
    """A factored optimizer's state on DeepSpeed ZeRO's flat 1-D partitions, where it cannot
    factor: a full second moment, 4 bytes per trainable parameter (CAME: 8, with its exp_avg;
    docs/distributed.md), as one process would hold it. None where it factors."""
    from effitrain.distributed import FACTORED_OPTIMIZERS

    if not sharding.startswith("zero") or optimizer not in FACTORED_OPTIMIZERS:
        return None
    per_parameter = 8 if optimizer == "came" else 4
    return memory.trainable_parameters * per_parameter
