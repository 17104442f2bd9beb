"""Tasks: what differs between sequence classification and causal-LM training.

A :class:`~effitrain.tasks.base.Task` owns the data pipeline, the model class, the loss and the
evaluation; :func:`resolve_task` picks the run's. Nothing heavy is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from effitrain.config import DECODER_TASKS
from effitrain.errors import EffitrainError
from effitrain.models import CAUSAL_PRESETS, PRESETS, load_model_config
from effitrain.tasks.base import (
    CAUSAL_LM,
    GRPO,
    GRPO_OPTIONS,
    PREFERENCE,
    PREFERENCE_OPTIONS,
    SEQUENCE_CLASSIFICATION,
    TASK_NAMES,
    Task,
)
from effitrain.tasks.causal_lm import CausalLMTask
from effitrain.tasks.classification import ClassificationTask
from effitrain.tasks.grpo import GrpoTask
from effitrain.tasks.preference import PreferenceTask

if TYPE_CHECKING:
    from effitrain.config import TrainConfig

TASKS: dict[str, Task] = {
    task.name: task for task in (ClassificationTask(), CausalLMTask(), PreferenceTask(), GrpoTask())
}

__all__ = [
    "CAUSAL_LM",
    "GRPO",
    "PREFERENCE",
    "SEQUENCE_CLASSIFICATION",
    "TASKS",
    "TASK_NAMES",
    "Task",
    "get_task",
]


def get_task(name: str) -> Task:
    """The task called ``name`` (one of :data:`~effitrain.tasks.base.TASK_NAMES`)."""
    try:
        return TASKS[name]
    except KeyError:
        raise EffitrainError(
            f"unknown --task '{name}'; choose one of: {', '.join(TASK_NAMES)}"
        ) from None


def check_options(config: TrainConfig) -> None:
    """Refuse a preset built for the other task, and options that belong to the other task,
    where the task is known without reading the model or the data.

    Raises:
        EffitrainError: naming the option.
    """
    if config.task in DECODER_TASKS and config.model in PRESETS:
        raise EffitrainError(
            f"--model {config.model} is a sequence-classification preset; for --task "
            f"{config.task} use one of: {', '.join(CAUSAL_PRESETS)} (or a causal LM's hub id or "
            "folder)"
        )
    if config.task not in (None, *DECODER_TASKS) and config.model in CAUSAL_PRESETS:
        raise EffitrainError(
            f"--model {config.model} is a causal-LM preset; use --task causal-lm, or a "
            f"classification preset: {', '.join(PRESETS)}"
        )
    if config.task is not None:
        get_task(config.task).check_options(config)
    elif config.model in PRESETS:
        TASKS[SEQUENCE_CLASSIFICATION].check_options(config)
    task = known_task(config)
    if task is not None:
        check_preference_options(config, task)


def check_preference_options(config: TrainConfig, task: str) -> None:
    """Refuse the preference losses' and GRPO's options under another task (they would do
    nothing); ``--beta`` is both's."""
    from effitrain.config import default_for, option

    for name in GRPO_OPTIONS:
        if task != GRPO and getattr(config, name) != default_for(name):
            raise EffitrainError(f"{option(name)} needs --task grpo (this run is {task}); drop it")
    if task == PREFERENCE:
        return
    for name in PREFERENCE_OPTIONS:
        if task == GRPO and name == "beta":
            continue
        if getattr(config, name) != default_for(name):
            raise EffitrainError(
                f"{option(name)} needs --task preference (this run is {task}); drop it"
            )


def known_task(config: TrainConfig) -> str | None:
    """The run's task where it is known without reading the model or the data: ``--task``, or a
    preset's; else None."""
    if config.task is not None:
        return config.task
    if config.model in PRESETS:
        return SEQUENCE_CLASSIFICATION
    return CAUSAL_LM if config.model in CAUSAL_PRESETS else None


def model_task(name: str) -> str | None:
    """The task a model is built for: a preset's, or from a hub/folder config's architectures
    (``*ForCausalLM``/``*LMHeadModel``: causal-lm); None when it cannot be told.

    Raises:
        EffitrainError: the model's config cannot be read.
    """
    if name in PRESETS:
        return SEQUENCE_CLASSIFICATION
    if name in CAUSAL_PRESETS:
        return CAUSAL_LM
    architectures = getattr(load_model_config(name), "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return CAUSAL_LM
    return SEQUENCE_CLASSIFICATION if architectures else None


def resolve_task(config: TrainConfig) -> Task:
    """``--task``, else the model's: a preset's own task; for a hub or folder causal LM,
    causal-lm unless the data has a label column (a decoder can classify too). The task's own
    option checks run on the result.

    Raises:
        EffitrainError: the model's config or the data cannot be read, or an option does not fit.
    """
    task = get_task(_task_name(config))
    task.check_options(config)
    check_preference_options(config, task.name)
    return task


def _task_name(config: TrainConfig) -> str:
    if config.task is not None:
        return config.task
    task = model_task(config.model)
    if task != CAUSAL_LM or config.model in CAUSAL_PRESETS:
        return task or SEQUENCE_CLASSIFICATION
    if config.label_column is not None or config.uses_builtin_data:
        return SEQUENCE_CLASSIFICATION  # the built-in demo is labelled sentence pairs
    from effitrain.tasks.lm_data import LM_FORMATS, has_label_column
    from effitrain.tasks.sources import load_splits

    splits, _, _ = load_splits(config, formats=LM_FORMATS)  # .txt files too
    first = splits.get("train") or next(iter(splits.values()))
    return SEQUENCE_CLASSIFICATION if has_label_column(first.column_names) else CAUSAL_LM
