"""Checkpoints that never lose work: save, rotate, find the latest, validate and resume.

Layout of an output folder::

    DIR/checkpoint-<global step>/   one complete checkpoint
        effitrain.json              written by effitrain, readable without torch (see below)
        model.safetensors           \
        optimizer.bin                |  accelerator.save_state: model, optimizer, scheduler,
        scheduler.bin                |  RNG states of every process
        random_states_<rank>.pkl    /
    DIR/final/                      save_pretrained model + tokenizer at the end of training
                                    (with --lora-rank: the adapters, peft's save_pretrained)
    DIR/final-merged/               --lora-merge: the adapters merged into the base model
    DIR/.tmp-checkpoint-<step>/     a save in progress (or left over from a crash): ignored

A save writes everything into ``.tmp-checkpoint-<step>``, fsyncs it, and only then renames it to
``checkpoint-<step>`` (``os.replace``: atomic on one file system). Old checkpoints are deleted
only after that rename, and never the newest complete one. Accelerate's own ``save_state``
rotates *before* writing and writes in place, which is why it is not called on the final folder.

``effitrain.json`` lists every file of the checkpoint with its size, so a folder that was copied
half-way or truncated is recognised as incomplete without reading any tensor.

Every process calls :func:`save_checkpoint` (each writes its own RNG state); only the main
process creates, renames and deletes folders, with barriers in between.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError, first_line
from effitrain.optim import set_train_mode

if TYPE_CHECKING:
    from accelerate import Accelerator

    from effitrain.config import TrainConfig
    from effitrain.progress import TrainingProgress

METADATA_FILE = "effitrain.json"
METADATA_FORMAT = "effitrain-checkpoint"
METADATA_VERSION = 1
CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
FINAL_DIR = "final"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")

# Options that do not change what is trained: they may differ between a run and its resume.
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


# --------------------------------------------------------------------------------------------
# Metadata (effitrain.json)
# --------------------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """Hyperparameters as JSON: tuples become lists, tensors numbers, unknown objects strings."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if hasattr(value, "numel") and hasattr(value, "tolist") and value.numel() == 1:
        return _json_value(value.tolist())  # a 0-d tensor lr (capturable optimizers)
    return str(value)


def param_group_hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as JSON: every hyperparameter, and ``params`` replaced by their count."""
    groups = []
    for group in param_groups:
        entry = {k: _json_value(v) for k, v in group.items() if k != "params"}
        entry["params"] = len(group.get("params", []))
        groups.append(entry)
    return groups


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape a checkpoint (installed ones only)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("effitrain", "torch", "transformers", "accelerate", "bitsandbytes", "peft"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def build_metadata(
    *,
    config: TrainConfig,
    progress: dict[str, Any],
    optimizer_name: str,
    optimizer_class: str,
    param_groups: list[dict[str, Any]],
    param_names: list[str],
    parameter_shapes: dict[str, list[int]],
    world_size: int,
    mixed_precision: str,
) -> dict[str, Any]:
    """The JSON written beside the tensors (``files`` is added when the save is complete).

    ``progress`` is the loop's ``TrainingProgress.state_dict()`` (its keys go at the top level);
    ``param_names`` are the optimizer's parameters in state-dict order (ids 0, 1, …), so
    ``inspect-state`` can name them; ``parameter_shapes`` are the model's, checked on resume.
    """
    return {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        **progress,
        "optimizer": {
            "name": optimizer_name,
            "class": optimizer_class,
            "param_groups": param_group_hyperparameters(param_groups),
            "param_names": param_names,
        },
        "parameters": parameter_shapes,
        "world_size": world_size,
        "mixed_precision": mixed_precision,
        "config": config.to_dict(),
        "versions": library_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_metadata(checkpoint: str | Path) -> dict[str, Any]:
    """Read and check a checkpoint's ``effitrain.json``, and that every listed file is whole.

    Raises:
        EffitrainError: missing folder, not an effitrain checkpoint, corrupt JSON, or a file
            missing or of the wrong size (an incomplete or truncated checkpoint).
    """
    path = Path(checkpoint)
    if not path.exists():
        raise EffitrainError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise EffitrainError(f"{path} is not a checkpoint folder (expected DIR/checkpoint-N)")
    meta_path = path / METADATA_FILE
    if not meta_path.is_file():
        raise EffitrainError(
            f"{path} is not a complete effitrain checkpoint (no {METADATA_FILE}); "
            "pick another one or use --resume latest"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise EffitrainError(
            f"{meta_path} is corrupt ({type(exc).__name__}); pick another checkpoint"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise EffitrainError(f"{meta_path} is not effitrain checkpoint metadata")
    if meta.get("version") != METADATA_VERSION:
        raise EffitrainError(
            f"{path} has checkpoint format version {meta.get('version')}; this effitrain reads "
            f"version {METADATA_VERSION}"
        )
    problem = _file_problem(path, meta.get("files"))
    if problem:
        raise EffitrainError(f"checkpoint {path} is incomplete or corrupt: {problem}")
    return meta


def _file_problem(path: Path, files: Any) -> str | None:
    """Why the files listed in the metadata do not match the folder (None when they do)."""
    if not isinstance(files, dict) or not files:
        return f"{METADATA_FILE} lists no files"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual:,} bytes, expected {size:,} (truncated or overwritten)"
    return None


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    """The global step in a ``checkpoint-<step>`` folder name, else None."""
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest first (complete or not)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        step = checkpoint_step(child)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def is_complete(path: Path) -> bool:
    """A checkpoint whose metadata reads and whose files all have their recorded sizes."""
    try:
        read_metadata(path)
    except EffitrainError:
        return False
    return True


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    return [path for _, path in list_checkpoints(output_dir) if is_complete(path)]


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in ``output_dir`` (incomplete ones and leftovers skipped)."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if is_complete(path):
            return path
    return None


def resolve_resume(resume: str, output_dir: str | None) -> Path:
    """The checkpoint folder that ``--resume`` names.

    ``latest``: the newest complete checkpoint in ``--output-dir``. A path: that checkpoint, or,
    for a folder holding ``checkpoint-*`` folders, the newest complete one in it.

    Raises:
        EffitrainError: nothing to resume from.
    """
    if resume == "latest":
        if not output_dir:
            raise EffitrainError(
                "--resume latest needs --output-dir (the folder with the checkpoints)"
            )
        latest = find_latest(output_dir)
        if latest is None:
            raise EffitrainError(
                f"--resume latest: no complete checkpoint in {output_dir}; "
                "drop --resume to start from scratch"
            )
        return latest
    path = Path(resume).expanduser()
    if path.is_dir() and not (path / METADATA_FILE).exists() and list_checkpoints(path):
        latest = find_latest(path)
        if latest is None:
            raise EffitrainError(f"--resume {resume}: no complete checkpoint in {path}")
        return latest
    return path


# --------------------------------------------------------------------------------------------
# Resume validation: before anything is loaded
# --------------------------------------------------------------------------------------------


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
) -> list[str]:
    """Options that differ from the checkpoint's run (resume is exact only without any),
    compared as ``used`` says a run uses them (an unset --max-grad-norm: its default)."""
    from effitrain.config import option

    saved = used(dict(meta.get("config", {})))
    current = used(config.to_dict())

    return [
        f"{option(key)[2:]} {saved.get(key)!r} -> {value!r}"
        for key, value in current.items()
        if key not in RUN_ONLY_OPTIONS and key in saved and saved[key] != value
    ]


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    """Flush a file or a folder entry to disk (best effort where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_leftovers(output_dir: Path) -> list[Path]:
    """Delete temporary folders left by failed or killed saves; return what was removed."""
    removed = []
    if not output_dir.is_dir():
        return removed
    for child in output_dir.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        child.name: child.stat().st_size
        for child in sorted(folder.iterdir())
        if child.is_file() and child.name != METADATA_FILE
    }


def _install(tmp: Path, final: Path) -> None:
    """Rename a complete temporary folder into place (replacing a stale folder of that name)."""
    if final.exists():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_path(final.parent)


def rotate(output_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the oldest complete checkpoints so that ``keep`` remain; never ``newest``.

    Incomplete ``checkpoint-*`` folders are left alone (they are ignored by resume, and a human
    may want to look at them). Returns the deleted folders.
    """
    complete = [path for path in complete_checkpoints(output_dir) if path != newest]
    surplus = len(complete) + 1 - keep
    deleted = []
    for path in complete[: max(surplus, 0)]:
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def _all_ok(accelerator: Accelerator, ok: bool) -> bool:
    """True when every process succeeded (a collective: all processes must call it)."""
    if accelerator.num_processes == 1:
        return ok
    import torch

    failures = torch.tensor(0.0 if ok else 1.0, device=accelerator.device)
    return float(accelerator.reduce(failures, "sum")) == 0.0


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    metadata: dict[str, Any],
    keep: int | None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete checkpoint ``output_dir/checkpoint-<step>`` or nothing at all.

    Called by every process. Steps: the main process prepares ``.tmp-checkpoint-<step>``;
    everyone writes into it with ``accelerator.save_state``; the main process writes
    ``effitrain.json`` (with every file's size), fsyncs, renames the folder into place, and
    only then deletes the oldest checkpoints beyond ``keep``. ``extra(folder)`` writes what
    the levers keep besides Accelerate's state (every process, into the temporary folder).

    Raises:
        EffitrainError: the save failed (full disk, permissions); the previous checkpoints are
            untouched and the temporary folder is removed.
    """
    output_dir = Path(output_dir)
    step = int(metadata["global_step"])
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f"{TMP_PREFIX}{final.name}"
    error: OSError | None = None
    if accelerator.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            clean_leftovers(output_dir)
            tmp.mkdir()
        except OSError as exc:
            error = exc
    accelerator.wait_for_everyone()
    if error is None and tmp.is_dir():
        try:
            accelerator.save_state(str(tmp))
            if extra is not None:
                extra(tmp)
        except OSError as exc:
            error = exc
    if _all_ok(accelerator, error is None) and accelerator.is_main_process:
        try:
            metadata = {**metadata, "files": _file_sizes(tmp)}
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
            for child in tmp.iterdir():
                _fsync_path(child)
            _fsync_path(tmp)
            _install(tmp, final)
        except OSError as exc:
            error = exc
    ok = _all_ok(accelerator, error is None)
    if not ok:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        reason = error.strerror or str(error) if error is not None else "failed on another process"
        previous = find_latest(output_dir)
        kept = f"; {previous.name} is intact" if previous else ""
        raise EffitrainError(f"could not write checkpoint {final}: {reason}{kept}")
    if keep is not None and accelerator.is_main_process:
        rotate(output_dir, keep, final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, strict: bool = True) -> None:
    """``accelerator.load_state`` with failures turned into one line (call after validating;
    ``strict=False`` only where the keys were checked, the levers' own, ``effitrain.levers.check_checkpoint``)."""
    try:
        accelerator.load_state(str(checkpoint), strict=strict)
    except Exception as exc:
        raise EffitrainError(f"cannot load checkpoint {checkpoint}: {first_line(exc)}") from exc


def save_final(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    output_dir: str | Path,
    folder: str = FINAL_DIR,
) -> Path:
    """Save model and tokenizer with ``save_pretrained`` (safetensors) to ``output_dir/final``
    (or ``folder``). A peft model saves its adapters (``adapter_model.safetensors``).

    Written to a temporary folder and renamed into place, like a checkpoint. Every process calls
    this (``get_state_dict`` gathers sharded weights); the main process writes.
    """
    output_dir = Path(output_dir)
    final = output_dir / folder
    tmp = output_dir / f"{TMP_PREFIX}{folder}"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            for child in tmp.iterdir():
                _fsync_path(child)
            _install(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EffitrainError(f"could not write {final}: {exc.strerror or exc}") from exc
    accelerator.wait_for_everyone()
    return final


# --------------------------------------------------------------------------------------------
# When to save, and saving for the loop
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPolicy:
    """When the loop saves: it asks at three moments and computes no flags of its own.

    - after an optimizer step: every ``--save-every`` steps, except at an epoch's last step (or
      the run's), whose checkpoint waits for the evaluation so that a resume does not evaluate
      that epoch again;
    - after an evaluation: at the end of every epoch with ``--save-strategy epoch``, at the end
      of the run, and at a ``--save-every`` step that the rule above postponed;
    - on a stop signal: whenever there is an ``--output-dir``, even with ``--save-strategy no``.
    """

    periodic: bool
    """Checkpoints during the run (``--save-every`` or ``--save-strategy epoch``, with a folder)."""
    on_stop: bool
    """A stop signal saves one (there is an ``--output-dir``)."""
    save_every: int | None
    every_epoch: bool
    total_steps: int
    steps_per_epoch: int

    @classmethod
    def from_config(
        cls, config: TrainConfig, total_steps: int, steps_per_epoch: int
    ) -> CheckpointPolicy:
        return cls(
            periodic=config.saves_checkpoints,
            on_stop=bool(config.output_dir),
            save_every=config.save_every,
            every_epoch=config.save_strategy == "epoch",
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
        )

    def _every(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save_after_step(self, step: int, step_in_epoch: int) -> bool:
        at_boundary = step_in_epoch >= self.steps_per_epoch or step >= self.total_steps
        return self.periodic and self._every(step) and not at_boundary

    def save_after_evaluation(self, step: int) -> bool:
        due = self.every_epoch or step >= self.total_steps or self._every(step)
        return self.periodic and due


class Checkpointer:
    """Saves the run's checkpoints when its :class:`CheckpointPolicy` says so.

    Every process calls its methods (saving is a collective); each save is written by
    :func:`save_checkpoint`, with the optimizer's identity and the model's parameter names and
    shapes in ``effitrain.json``.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        policy: CheckpointPolicy,
        optimizer: Any,
        optimizer_name: str,
        optimizer_class: str,
        param_names: list[str],
        parameter_shapes: dict[str, list[int]],
        save_extra: Callable[[Path], None] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.config = config
        self.policy = policy
        self.optimizer = optimizer
        self.optimizer_name = optimizer_name
        self.optimizer_class = optimizer_class
        self.param_names = param_names
        self.parameter_shapes = parameter_shapes
        self.save_extra = save_extra
        """Writes what the levers keep in a checkpoint besides Accelerate's state."""
        self.last_saved_step = -1
        """A resumed run starts with its checkpoint's step: that one is not written again."""
        self.last_path: Path | None = None

    def save(self, progress: TrainingProgress) -> Path:
        """Write ``checkpoint-<global step>`` now (all processes).

        Always in the optimizer's train mode (schedule-free), whatever it was in: a resumed run
        continues from the very weights and state that the uninterrupted run trains on."""
        set_train_mode(self.optimizer, True)
        metadata = build_metadata(
            config=self.config,
            progress=progress.state_dict(),
            optimizer_name=self.optimizer_name,
            optimizer_class=self.optimizer_class,
            param_groups=self.optimizer.param_groups,
            param_names=self.param_names,
            parameter_shapes=self.parameter_shapes,
            world_size=self.accelerator.num_processes,
            mixed_precision=self.accelerator.mixed_precision,
        )
        path = save_checkpoint(
            self.accelerator,
            self.config.output_dir,
            metadata,
            self.config.save_total_limit,
            self.save_extra,
        )
        self.last_saved_step, self.last_path = progress.global_step, path
        return path

    def after_step(self, progress: TrainingProgress) -> Path | None:
        if self.policy.save_after_step(progress.global_step, progress.step_in_epoch):
            return self.save(progress)
        return None

    def after_evaluation(self, progress: TrainingProgress) -> Path | None:
        step = progress.global_step
        if self.policy.save_after_evaluation(step) and self.last_saved_step != step:
            return self.save(progress)
        return None

    def on_stop(self, progress: TrainingProgress) -> Path | None:
        return self.save(progress) if self.policy.on_stop else None


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
