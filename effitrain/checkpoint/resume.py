"""Resuming: which checkpoint, and checks before it is trusted (the folder, its metadata, the
optimizer's and the scheduler's own step counts, the options it was trained with), loading it,
and the command that resumes a stopped run."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.checkpoint.metadata import (
    METADATA_FILE,
    checkpoint_step,
    latest,
    list_checkpoints,
    param_group_hyperparameters,
    step_counters,
)
from effitrain.errors import EffitrainError, first_line

if TYPE_CHECKING:
    from accelerate import Accelerator

    from effitrain.config import TrainConfig

RUN_ONLY_OPTIONS = frozenset(
    {
        "output_dir",
        "metrics_json",
        "quiet",
        "memory_breakdown",
        "log_every",
        "save_every",
        "save_strategy",
        "save_total_limit",
        "resume",
        "eval_batch_size",
        "report_to",
    }
)
"""Options that do not change what is trained: they may differ between a run and its resume."""

SCHEDULE_OPTIONS = {"lr": "--lr", "scheduler": "--scheduler", "warmup_steps": "--warmup-steps"}
"""What a resumed run cannot change: the restored scheduler continues the checkpoint's lr
schedule (its lr, its shape, its warmup), whatever the options say."""


def resolve_resume(resume: str, output_dir: str | None) -> tuple[Path, list[str]]:
    """The checkpoint folder that ``--resume`` names, and why each newer checkpoint was skipped
    (one line each, to be said: a skipped checkpoint is steps that will be trained again).

    ``latest``: the newest complete checkpoint in ``--output-dir``. A path: that checkpoint, or,
    for a folder holding ``checkpoint-*`` folders, the newest complete one in it.

    Raises:
        EffitrainError: nothing to resume from (naming what was skipped).
    """
    folder: Path | None = None
    if resume == "latest":
        if not output_dir:
            raise EffitrainError(
                "--resume latest needs --output-dir (the folder with the checkpoints)"
            )
        folder = Path(output_dir)
    else:
        path = Path(resume).expanduser()
        if path.is_dir() and not (path / METADATA_FILE).exists() and list_checkpoints(path):
            folder = path
        else:
            return path, []
    found, skipped = latest(folder)
    if found is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise EffitrainError(
            f"--resume {resume}: no complete checkpoint in {folder}{why}; drop --resume to "
            "start from scratch"
        )
    return found, skipped


def check_resumable(
    meta: dict[str, Any],
    checkpoint: Path,
    *,
    optimizer_name: str,
    optimizer_class: str,
    param_groups: list[dict[str, Any]],
    parameter_shapes: dict[str, list[int]],
    fp32_embedding_state: bool = False,
) -> None:
    """Fail with one line when the checkpoint cannot continue this run exactly as configured.

    Checked: the optimizer (name and class), the model's parameter names and shapes, every
    optimizer hyperparameter (``Optimizer.load_state_dict`` would otherwise silently replace this
    run's hyperparameters with the checkpoint's, or accept another optimizer's state), and the
    embeddings' state width (bitsandbytes would apply a 32-bit update to 8-bit state).

    Raises:
        EffitrainError: naming the first difference and how to fix it.
    """
    saved = meta.get("optimizer", {})
    if saved.get("name") == optimizer_name and saved.get("class") != optimizer_class:
        raise EffitrainError(
            f"{checkpoint} was trained with {saved.get('class')}, this run builds "
            f"{optimizer_class} (another --weights-dtype?); resume with the checkpoint's "
            "options or start a new --output-dir"
        )
    if saved.get("name") != optimizer_name or saved.get("class") != optimizer_class:
        raise EffitrainError(
            f"{checkpoint} was trained with --optim {saved.get('name')} ({saved.get('class')}), "
            f"this run uses --optim {optimizer_name}; resume with --optim {saved.get('name')} "
            "or start a new --output-dir"
        )
    _check_shapes(meta.get("parameters", {}), parameter_shapes, checkpoint)
    saved_fp32 = bool(meta.get("config", {}).get("fp32_embedding_state"))
    if saved_fp32 != fp32_embedding_state:
        width = {True: "32-bit", False: "8-bit"}
        flag = "add" if saved_fp32 else "drop"
        raise EffitrainError(
            f"{checkpoint} keeps {width[saved_fp32]} optimizer state for the embeddings, this "
            f"run {width[fp32_embedding_state]}; {flag} --fp32-embedding-state to resume, or "
            "start a new --output-dir"
        )
    _check_hyperparameters(
        saved.get("param_groups", []), param_group_hyperparameters(param_groups), checkpoint
    )


def _check_shapes(saved: dict[str, Any], current: dict[str, list[int]], checkpoint: Path) -> None:
    for name, shape in current.items():
        if name not in saved:
            raise EffitrainError(
                f"model mismatch: parameter {name} is not in {checkpoint}; resume with the same --model"
            )
        if list(saved[name]) != list(shape):
            raise EffitrainError(
                f"model mismatch: {name} has shape {list(saved[name])} in {checkpoint} but "
                f"{list(shape)} here (different --model or number of labels?)"
            )
    extra = [name for name in saved if name not in current]
    if extra:
        raise EffitrainError(
            f"model mismatch: {checkpoint} has parameter {extra[0]} that this model lacks; "
            "resume with the same --model"
        )


# The scheduler owns lr; its saved state is loaded with the rest. torch-optimi (bf16 weights)
# keeps its step counter, a setup flag and the kernel it chose at the first step (triton) in
# each param group: state, not options, also loaded with the rest. So do pytorch-optimizer's
# CAME (step) and schedule-free (k, its average's weight_sum and lr_max, scheduled_lr, and
# train_mode).
_SCHEDULED = frozenset({"lr", "initial_lr", "step", "setup", "triton"}) | frozenset(
    {"k", "weight_sum", "lr_max", "scheduled_lr", "train_mode"}
)


def _check_hyperparameters(
    saved: list[dict[str, Any]], current: list[dict[str, Any]], checkpoint: Path
) -> None:
    if len(saved) != len(current):
        raise EffitrainError(
            f"optimizer mismatch: {checkpoint} has {len(saved)} parameter groups, this run "
            f"{len(current)}; resume with the same options"
        )
    for index, (old, new) in enumerate(zip(saved, current, strict=True)):
        for key in sorted(set(old) | set(new)):
            if key in _SCHEDULED:
                continue
            if old.get(key) != new.get(key):
                raise EffitrainError(
                    f"optimizer mismatch: param group {index} {key} is {old.get(key)!r} in "
                    f"{checkpoint} but {new.get(key)!r} in this run; resume with the same options "
                    "(e.g. --weight-decay) or start a new --output-dir"
                )


def config_differences(
    meta: dict[str, Any],
    config: TrainConfig,
    used: Callable[[dict[str, Any]], dict[str, Any]] = lambda values: values,
    num_processes: int = 1,
) -> list[str]:
    """Options that differ from the checkpoint's run (resume is exact only without any),
    compared as ``used`` says a run uses them (an unset --max-grad-norm: its default). What
    :func:`continued_config` changes to continue the same run is no difference: the batch and
    the accumulation that keep the global batch on ``num_processes``, the warmup the
    checkpoint's run derived."""
    from effitrain.config import option

    saved = used(dict(meta.get("config", {})))
    current = used(config.to_dict())
    same = set(RUN_ONLY_OPTIONS)
    if _global_batch(saved, meta.get("world_size") or 1) == _global_batch(current, num_processes):
        same |= {"batch_size", "grad_accum"}
    if saved.get("warmup_steps") is None and current.get("warmup_steps") == (
        meta.get("schedule") or {}
    ).get("warmup_steps"):
        same.add("warmup_steps")
    return [
        f"{option(key)[2:]} {saved.get(key)!r} -> {value!r}"
        for key, value in current.items()
        if key not in same and key in saved and saved[key] != value
    ]


def _global_batch(values: dict[str, Any], num_processes: int) -> Any:
    batch, accum = values.get("batch_size"), values.get("grad_accum")
    if isinstance(batch, int) and isinstance(accum, int):
        return batch * accum * num_processes
    return None


def check_step(meta: dict[str, Any], checkpoint: Path) -> None:
    """A ``checkpoint-<step>`` folder's name and its metadata name the same step.

    Raises:
        EffitrainError: they differ (a renamed folder, an edited ``effitrain.json``).
    """
    named = checkpoint_step(checkpoint)
    if named is not None and named != meta.get("global_step"):
        raise EffitrainError(
            f"{checkpoint} is inconsistent: its folder name says step {named}, its "
            f"{METADATA_FILE} step {meta.get('global_step')} (a renamed folder or edited "
            "metadata); resume from another checkpoint"
        )


def check_schedule(
    meta: dict[str, Any], schedule: dict[str, Any], config: TrainConfig, checkpoint: Path
) -> list[str]:
    """This run's lr schedule against the checkpoint's: the lr, the scheduler and the warmup must
    be the same (the restored scheduler would keep the checkpoint's and quietly ignore the
    options); a new length is taken, and said. ``schedule``: this run's ``lr``, ``scheduler``,
    ``warmup_steps`` and ``total_steps``. Returns the notes.

    Raises:
        EffitrainError: one line naming the option, both values, and the way out.
    """
    saved = meta.get("schedule") or {}
    if not saved:  # an older checkpoint: compare the options as written
        saved_config = meta.get("config", {})
        for key, flag in (("lr", "--lr"), ("scheduler", "--scheduler")):
            old, new = saved_config.get(key), getattr(config, key)
            if old != new:
                raise _schedule_changed(flag, old, new, checkpoint)
        return []
    for key, flag in SCHEDULE_OPTIONS.items():
        old, new = saved.get(key), schedule.get(key)
        if old is not None and old != new:
            raise _schedule_changed(flag, old, new, checkpoint)
    old_total, new_total = saved.get("total_steps"), schedule.get("total_steps")
    if old_total is not None and old_total != new_total:
        return [
            f"the schedule now runs to step {new_total} (the checkpoint's run: {old_total}): the "
            "lr from the resumed step on follows the new length"
        ]
    return []


def _schedule_changed(flag: str, old: Any, new: Any, checkpoint: Path) -> EffitrainError:
    def shown(value: Any) -> str:
        return (
            "the default"
            if value is None
            else f"{value:g}"
            if isinstance(value, float)
            else str(value)
        )

    way = f"without {flag}" if old is None else f"with {flag} {shown(old)}"
    return EffitrainError(
        f"{flag} is {shown(new)} in this run but was {shown(old)} in {checkpoint}'s: a resumed "
        f"run continues the checkpoint's lr schedule, so it cannot change; resume {way}, or "
        "start a new --output-dir"
    )


def check_counters(
    meta: dict[str, Any], checkpoint: Path, optimizer: Any, lr_scheduler: Any
) -> None:
    """After loading, before the first step: the steps the loaded scheduler and optimizer have
    counted agree with the metadata's step (the scheduler steps once per process per optimizer
    step; fp16's loss scaler may skip steps) and with what was recorded when it was saved.

    Raises:
        EffitrainError: they disagree (files mixed from another checkpoint, a renamed folder
            with edited metadata).
    """
    loaded = step_counters(optimizer, lr_scheduler)
    step, world = meta.get("global_step"), meta.get("world_size") or 1
    problems = []
    for key, value in (meta.get("counters") or {}).items():
        if value is not None and loaded.get(key) != value:
            problems.append(f"its {key.replace('_', ' ')} are {loaded.get(key)}, recorded {value}")
    scheduler_steps, expected = loaded["scheduler_steps"], (step or 0) * world
    skips = meta.get("mixed_precision") == "fp16"  # the scaler skips overflowing steps
    if scheduler_steps > expected or (scheduler_steps != expected and not skips):
        problems.append(
            f"its scheduler has stepped {scheduler_steps} times, and step {step} on {world} "
            f"process(es) means {expected}"
        )
    if problems:
        raise EffitrainError(
            f"{checkpoint} is inconsistent: {METADATA_FILE} says step {step}, but "
            f"{'; '.join(problems)} (files mixed from another checkpoint, or a renamed folder "
            "with edited metadata); resume from another checkpoint"
        )


def random_state_problem(checkpoint: Path, process_index: int) -> str | None:
    """Why this process's RNG state in ``checkpoint`` cannot be restored, else None.
    Accelerate's ``load_state`` swallows that failure (at INFO level): the resume goes on with
    the current RNG, no longer an exact continuation, unless someone says so."""
    from accelerate.utils.other import load

    path = checkpoint / f"random_states_{process_index}.pkl"
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            states = load(path, weights_only=True)
    except Exception as exc:  # a truncated or tampered pickle, any way it fails
        return f"{path.name} cannot be read ({first_line(exc)[:120]})"
    wanted = ("random_state", "numpy_random_seed", "torch_manual_seed")
    missing = [key for key in wanted if key not in (states if isinstance(states, dict) else {})]
    return f"{path.name} lacks {', '.join(missing)}" if missing else None


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, strict: bool = True) -> None:
    """``accelerator.load_state`` with failures turned into one line and its warnings kept off
    the console (call after validating; ``strict=False`` only where a lever checked the keys,
    ``effitrain.levers.check_checkpoint``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accelerator.load_state(str(checkpoint), strict=strict)
    except Exception as exc:
        raise EffitrainError(f"cannot load checkpoint {checkpoint}: {first_line(exc)}") from exc


def resume_command(config: TrainConfig, num_processes: int) -> str:
    """The command that continues this run: the same non-default options, spelled as
    ``effitrain train`` takes them (:func:`effitrain.config.to_arguments`), plus ``--resume
    latest``; under ``accelerate launch`` (``num_processes`` > 1) its launch options are the
    user's to repeat."""
    import dataclasses
    import shlex

    from effitrain.config import TrainConfig, to_arguments

    defaults = TrainConfig()
    changed = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name != "resume" and getattr(config, f.name) != getattr(defaults, f.name)
    }
    words = [*to_arguments(changed), "--resume", "latest"]
    launcher = (
        "accelerate launch <same launch options> -m effitrain" if num_processes > 1 else "effitrain"
    )
    return f"{launcher} train {shlex.join(words)}"


def continued_config(
    config: TrainConfig, meta: dict[str, Any], checkpoint: Path, num_processes: int
) -> tuple[TrainConfig, list[str]]:
    """This run's options as they continue the checkpoint's run (before anything is built: the
    accumulation and the schedule's length shape the data loaders and the scheduler); returns
    the options and what was changed, one note each.

    - On another process count the global batch (per-process batch x processes x accumulation)
      is kept by changing ``--grad-accum`` where the user left it as the checkpoint had it.
    - A warmup the checkpoint's run derived from its length (no ``--warmup-steps``) stays the
      checkpoint's when the run is extended or cut: the warmup already done cannot change.

    Raises:
        EffitrainError: the global batch cannot be kept on ``num_processes`` (one line with the
            options that would keep it).
    """
    import dataclasses

    saved_config, saved_world = meta.get("config", {}), meta.get("world_size") or 1
    changes: dict[str, Any] = {}
    notes = []
    saved_batch, saved_accum = saved_config.get("batch_size"), saved_config.get("grad_accum")
    wanted = _global_batch(saved_config, saved_world)
    if saved_world != num_processes and wanted is not None:
        batch, accum = config.batch_size, config.grad_accum
        written = (
            f"the checkpoint was written by {saved_world} process(es), this run has {num_processes}"
        )
        if batch * num_processes * accum == wanted:
            notes.append(f"{written}: the same global batch of {wanted}, its lr schedule continued")
        else:
            share, left = divmod(wanted, batch * num_processes)
            if accum != saved_accum or left or share == 0:
                raise EffitrainError(
                    f"{checkpoint} was trained with a global batch of {wanted} ({saved_world} "
                    f"process(es) x {saved_batch} x {saved_accum} accumulated); "
                    f"{_batch_way(wanted, num_processes, batch)}"
                )
            changes["grad_accum"] = share
            notes.append(
                f"{written}: --grad-accum {share} keeps its global batch of {wanted} "
                f"({saved_world} x {saved_batch} x {saved_accum} before)"
            )
    saved_warmup = (meta.get("schedule") or {}).get("warmup_steps")
    if (
        config.warmup_steps is None
        and saved_config.get("warmup_steps") is None
        and config.warmup_ratio == saved_config.get("warmup_ratio")  # a new ratio: refused later
        and isinstance(saved_warmup, int)
    ):
        changes["warmup_steps"] = saved_warmup  # derived from the first run's length: kept
    return dataclasses.replace(config, **changes), notes


def _batch_way(wanted: int, num_processes: int, batch: int) -> str:
    """How ``num_processes`` keep a global batch of ``wanted``, or why they cannot."""
    if wanted % num_processes:
        return (
            f"{num_processes} processes cannot split it evenly: resume on a process count "
            f"that divides {wanted}"
        )
    per_process = wanted // num_processes
    if per_process % batch == 0:
        way = f"--batch-size {batch} --grad-accum {per_process // batch}"
    else:
        way = f"--batch-size {per_process} --grad-accum 1"
    return f"on {num_processes} process(es) resume with {way} to keep it"


def continue_schedule(lr_scheduler: Any, meta: dict[str, Any], num_processes: int) -> None:
    """Carry the loaded lr schedule over to this run's process count (after
    :func:`check_counters`). Accelerate's prepared scheduler steps once per process on every
    optimizer step, so the position it saved counts the checkpoint's processes; left as loaded,
    a 2-process checkpoint resumed by one process would be twice as far along (lr 0 at its end).
    The position becomes the same optimizer step counted in this run's processes, and the
    param groups take the lr of that position."""
    saved_world = meta.get("world_size") or 1
    if saved_world == num_processes:
        return
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
    position = scheduler.last_epoch * num_processes // saved_world
    scheduler.last_epoch = position
    scheduler._step_count = position + 1  # what stepping to ``position`` would have counted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "get_lr() outside step()": called on purpose
        rates = scheduler.get_lr()
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def check_layout(checkpoint: Path, fsdp_now: bool) -> None:
    """The checkpoint's files are the kind this launch loads: Accelerate writes a run under FSDP
    as ``pytorch_model_fsdp_*`` (sharded: torch.distributed.checkpoint folders, one piece per
    process, resharded to any process count on load) and any other run as ``model.safetensors``;
    neither loads the other's. ``fsdp_now``: this launch is FSDP's (1 or 2).

    Raises:
        EffitrainError: the launch cannot load these files (one line: how to resume them).
    """
    saved_under_fsdp = any(checkpoint.glob("pytorch_model_fsdp_*"))
    if saved_under_fsdp and not fsdp_now:
        raise EffitrainError(
            f"{checkpoint} was saved under FSDP (its model and optimizer sharded by "
            "torch.distributed.checkpoint), so only an FSDP launch can load it: resume with "
            "accelerate launch --config_file <your FSDP config> --num_processes N -m effitrain "
            "train ... (any N; configs/accelerate/fsdp2-full-shard.yaml is one)"
        )
    if fsdp_now and not saved_under_fsdp:
        raise EffitrainError(
            f"{checkpoint} was saved without FSDP (a whole model.safetensors and optimizer.bin), "
            "so an FSDP launch cannot load it: resume it on one process or under DDP "
            "(accelerate launch --multi_gpu --num_processes N -m effitrain train ...)"
        )
