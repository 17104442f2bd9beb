"""GRPO's reward functions: ``--reward FILE.py:FUNCTION`` loaded from a Python file, or the
built-in demo reward, each called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls one:
keyword arguments ``prompts``, ``completions`` (texts), ``completion_ids`` (lists of token ids)
and each of the dataset's other columns (one value per completion), returning one float per
completion, or None where it does not apply (NaN here; the weighted sum over functions is a
``nansum``, as TRL's).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.errors import EffitrainError

if TYPE_CHECKING:
    import torch

DEMO_LETTER = "e"
"""The letter the demo reward counts."""


def letter_share(completions: list[str], **kwargs: Any) -> list[float]:
    """The built-in demo reward: the share of each completion's letters that are
    :data:`DEMO_LETTER`. A random model writes it at the corpus's rate, some completions more
    than others, so every group has a spread to learn from from the first step."""
    shares = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        shares.append(letters.count(DEMO_LETTER) / len(letters) if letters else 0.0)
    return shares


@dataclass(frozen=True)
class RewardFunction:
    """One reward function and the name its metrics carry (``rewards/<name>/mean``)."""

    name: str
    function: Callable[..., Any]
    source: str
    """Where it came from, for errors: ``FILE.py:FUNCTION`` or ``built-in``."""


BUILTIN = RewardFunction("letter_share", letter_share, "built-in")


def check_reward_spec(spec: str) -> tuple[Path, str]:
    """``FILE.py:FUNCTION`` split into a file and a function name (the file is read later).

    Raises:
        EffitrainError: not of that shape.
    """
    path, _, function = spec.rpartition(":")
    if not path or not function.isidentifier() or not path.endswith(".py"):
        raise EffitrainError(
            f"--reward {spec}: expected FILE.py:FUNCTION (a Python file and the name of a "
            "function in it)"
        )
    return Path(path).expanduser(), function


def load_reward(spec: str) -> RewardFunction:
    """The function ``spec`` (``FILE.py:FUNCTION``) names, its file run as a module.

    Raises:
        EffitrainError: a bad spec, a file that fails to run, no such function.
    """
    file, name = check_reward_spec(spec)
    if not file.is_file():
        raise EffitrainError(f"--reward {spec}: no such file {file}")
    module_name = f"effitrain_reward_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    if module_spec is None or module_spec.loader is None:
        raise EffitrainError(f"--reward {spec}: cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise EffitrainError(
            f"--reward {spec}: running {file} raised {type(exc).__name__}: {exc}"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise EffitrainError(
            f"--reward {spec}: {file} has no function '{name}'"
            + (f" (it has: {', '.join(found)})" if found else "")
        )
    return RewardFunction(getattr(function, "__name__", name), function, spec)


def load_rewards(specs: list[str] | None) -> list[RewardFunction]:
    """The run's reward functions: each ``--reward``, else the built-in demo reward."""
    return [load_reward(spec) for spec in specs] if specs else [BUILTIN]


def check_weights(weights: list[float] | None, rewards: Sequence[object]) -> list[float]:
    """``--reward-weights``, or 1 for each function.

    Raises:
        EffitrainError: not one weight per reward function.
    """
    if weights is None:
        return [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise EffitrainError(
            f"--reward-weights has {len(weights)} weights for {len(rewards)} reward functions; "
            "give one per --reward"
        )
    return [float(w) for w in weights]


def _checked(reward: RewardFunction, output: Any, count: int) -> list[float]:
    """The function's output as floats (None as NaN), refused unless one number per completion."""
    expected = f"it must return a list of one float (or None) per completion, {count} here"
    if isinstance(output, str | bytes) or not isinstance(output, Sequence):
        raise EffitrainError(
            f"reward function '{reward.name}' ({reward.source}) returned "
            f"{type(output).__name__}: {expected}"
        )
    if len(output) != count:
        raise EffitrainError(
            f"reward function '{reward.name}' ({reward.source}) returned {len(output)} "
            f"rewards: {expected}"
        )
    values = []
    for value in output:
        if value is None:
            values.append(math.nan)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            values.append(float(value))
        else:
            raise EffitrainError(
                f"reward function '{reward.name}' ({reward.source}) returned a "
                f"{type(value).__name__} among its rewards: {expected}"
            )
    return values


def score(
    rewards: Sequence[RewardFunction],
    rows: list[dict[str, Any]],
    prompts: list[Any],
    completions: list[str],
    completion_ids: list[list[int]],
) -> torch.Tensor:
    """Each completion's reward from each function (``[completions, functions]``, fp32, NaN
    where a function returned None), called as TRL calls them; ``rows``: each completion's
    dataset row, whose columns other than ``prompt`` are passed by name.

    Raises:
        EffitrainError: a function raised, or did not return one number per completion.
    """
    import torch

    columns = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
    extra = {key: [row[key] for row in rows] for key in columns}
    table = []
    for reward in rewards:
        try:
            output = reward.function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **extra
            )
        except EffitrainError:
            raise
        except Exception as exc:
            raise EffitrainError(
                f"reward function '{reward.name}' ({reward.source}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from None
        table.append(_checked(reward, output, len(completions)))
    return torch.tensor(table, dtype=torch.float32).T.contiguous()
