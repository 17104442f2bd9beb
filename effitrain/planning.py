"""``effitrain plan``: the fastest configuration that fits a memory budget, searched on fake tensors.

What a candidate is: an optimizer, a set of levers and a split of the asked global batch
(``--batch-size`` x ``--grad-accum``) into micro-batch x accumulation. What it holds: the
estimate's measurement (:func:`effitrain.estimation.estimate`, the run's own step on fake
tensors). What it costs in time: the same step's counted work (:class:`effitrain.cost.StepCost`)
through :func:`effitrain.cost.modeled_step_seconds`. Nothing here models memory by formula; it
decides which configurations to estimate, and how to estimate many of them quickly:

- **Layers.** A decoder's layers are alike, so every part of a step (parameters, gradients,
  state, activations, the peak, the FLOPs) grows by the same amount per layer: each screened
  configuration is estimated with the model cut to one and to two layers (about a second each,
  at any width) and extended to the model's depth along that line
  (:mod:`effitrain.plan_screens`).
- **Levers, one at a time, per optimizer.** From the user's configuration, the levers that
  declare a search (``Lever.search``) are added in its order (the cheapest in time first,
  :func:`_ladder`), each kept only where it lowers that optimizer's peak; every configuration
  on the way is a candidate, in full fine-tuning and with LoRA adapters. What needs a package that is not installed is left out
  for the optimizers it needs it for, and named.
- **Optimizers.** One is estimated per lever set (of those that run it, the one with the most
  state); the others' state is its measured state scaled by their measured bytes per parameter
  (``effitrain/optim/state_bytes.json``).
- **Micro-batches.** Estimated at the task's smallest micro-batch (1; GRPO: one prompt's
  group of G completions); m of those hold the parameters, gradients and state once and m
  times the rest of the peak (an upper bound: the rest is activations and the step's working
  tensors, at most proportional to the tokens). A step in two phases (GRPO: its completions
  generated, then trained on) is screened so phase by phase, and its peak is the larger
  (:meth:`effitrain.plan_screens.Screen.peak_at`).

Those are screens, not results: the candidates that rank first are **verified** by a full
estimate of the exact configuration, and the ranking uses the verified figures (a candidate
that does not fit once verified is dropped) until the first :data:`VERIFIED` all are. Only
verified candidates are answers. Slow verifications run side by side in worker processes
(:mod:`effitrain.plan_workers`).

With ``longest`` the question is the longest sequence that fits instead: every lever of the
search on, the lengths searched on the same screens (:mod:`effitrain.plan_lengths`), the
length found verified by a full estimate (:func:`_longest`).
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import time
from collections.abc import Callable, Iterator
from typing import Any

import effitrain.levers as lever_registry
from effitrain.build import check_config, check_launch, resolve_optimizer_spec
from effitrain.config import TrainConfig, option, to_arguments
from effitrain.cost import StepCost, modeled_step_seconds
from effitrain.distributed import Launch
from effitrain.errors import EffitrainError, MissingPackage
from effitrain.estimation import SHARDED, estimate
from effitrain.levers.spec import Lever, Search
from effitrain.plan_lengths import Found
from effitrain.plan_screens import Screen, cut_to, device_peak, extend, screen_of
from effitrain.plan_workers import Verifiers
from effitrain.results import Estimate, PlanCandidate, PlanResult

DEFAULT_OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor")
"""What a plan tries without ``--optim``: full state, 8-bit state, factored state."""
SMALL_SHARE = 0.02
"""A lever that removes only gradients and optimizer state (``Search.removes_only_update``) is
not tried where those are under this share of the peak (LoRA's adapters)."""
VERIFIED = 3
"""Candidates verified by a full estimate: at least the first this many printed."""
MAX_VERIFICATIONS = 8
"""Full estimates at most per plan (each takes seconds on a large model)."""
STEP_DOWNS = 3
"""Lengths verified at most after the first, where the longest's full estimates do not fit."""
SHOWN = 10
"""Candidates kept in the result, best first."""
CUDA_CONTEXT = 512 * 2**20
CUDA_CACHE_SHARE = 0.10


def margin_bytes(budget: int, device_type: str) -> int:
    """What a process holds besides its tensors, kept free of the budget. On CUDA: the context
    and cuBLAS workspaces (a fixed 512 MiB) and the caching allocator's unused blocks (10 % of
    the budget; benchmarks/estimate measures CUDA's count 5-15 % above the estimate's). On the
    CPU, 0: the budget is compared with tensor bytes, as ``train --max-memory`` measures them
    (the libraries' own memory is the host's, not the budget's)."""
    if device_type == "cpu":
        return 0
    return CUDA_CONTEXT + int(CUDA_CACHE_SHARE * budget)


def _adapter_lever() -> tuple[Lever, Search]:
    """The lever whose search is the plan's mode (full fine-tuning or adapters): the one that
    trains adapters and declares a search."""
    return next(
        (lever, lever.search)
        for lever in lever_registry.LEVERS.values()
        if lever.trains_adapters and lever.search is not None
    )


def _ladder() -> list[tuple[Lever, Search]]:
    """The other levers that declare a search, in its order: the order they are added in,
    cheapest in time first. Each is tried at its search values after the first (off) one."""
    searched = [
        (lever, lever.search)
        for lever in lever_registry.LEVERS.values()
        if lever.search is not None and not lever.trains_adapters
    ]
    return sorted(searched, key=lambda pair: pair[1].order)


@dataclasses.dataclass(frozen=True)
class Option:
    """One screened candidate before verification."""

    changes: dict[str, Any]
    """The config fields the plan sets (optimizer, levers, batch split)."""
    reasons: dict[str, str]
    full_parameter: bool
    peak: int
    cost: StepCost | None
    phase: str | None = None
    """The phase of its peak where a step has two (GRPO's ``generation`` or ``training``)."""


def _checked(
    config: TrainConfig, launch: Launch, optimizers: list[str], without: list[str], longest: bool
) -> tuple[str, int]:
    """The task and its batch unit (:func:`_task`), once the levers left out, the optimizers
    and ``longest`` are known to apply.

    Raises:
        EffitrainError: an unknown lever or optimizer; ``longest`` for a task whose batch unit
            is more than one row (GRPO's group).
    """
    from effitrain.optim import get_spec

    for name in without:
        lever_registry.get_lever(name)
    for name in optimizers:
        get_spec(name)
    task, unit = _task(config, launch)
    if longest and unit > 1:
        raise EffitrainError(
            f"--max-length longest is not searched for --task {task}: give the prompts' "
            "length (--max-length N) and --max-completion-length"
        )
    return task, unit


def plan(
    config: TrainConfig,
    launch: Launch,
    budget: int,
    *,
    given: dict[str, Any] | None = None,
    config_file: str | None = None,
    full_parameter: bool = False,
    optimizers: list[str] | None = None,
    without: list[str] = (),  # type: ignore[assignment]
    workers: int | None = None,
    worker_setup: Callable[[], None] | None = None,
    longest: bool = False,
    answers: int = VERIFIED,
    optimizer_class: str | None = None,
) -> PlanResult:
    """The configurations of ``config`` that fit ``budget`` bytes per device on ``launch``,
    fastest first by modeled step time. ``given`` and ``config_file``: the options the user
    gave (each printed command starts with them, less those the plan sets). ``workers``:
    processes that verify side by side (None: one per core, up to :data:`VERIFIED`, where a
    verification is slow, see :data:`effitrain.plan_workers.PARALLEL_FROM_SECONDS`; 0: verified
    in this process), each first calling ``worker_setup`` (a module-level function: the CLI's
    quieting). ``longest``: the longest sequence that fits instead (``config``'s max_length
    aside), and the configurations that fit it (:func:`_longest`). ``answers``: how many
    verified candidates to find (the search stops once that many fit, and the first that many
    are verified; ``train --max-memory``'s advice wants one). ``optimizer_class``: only
    configurations whose optimizer is of this class (a resume's: its checkpoint's).

    Raises:
        EffitrainError: bad options, or nothing fits (the message names the smallest peak).
    """
    start = time.monotonic()
    config = dataclasses.replace(config, max_memory=None)  # the steps, as a plain run takes them
    names = list(optimizers or DEFAULT_OPTIMIZERS)
    task, unit = _checked(config, launch, names, without, longest)
    if longest:
        workers = 0  # one round of verification: warming workers would cost more than it saves
    search = _Search(
        config, launch, budget, names, without, given or {}, workers, worker_setup, task, unit,
        wanted=answers, optimizer_class=optimizer_class,
    )  # fmt: skip
    command = functools.partial(_command, launch, config_file, given or {})
    if longest:
        return _longest(search, start, command, full_parameter)
    margin = search.margin
    with search:
        options = search.options(full_parameter)
        left_out = search.missing_note()
        if not options:
            raise EffitrainError(
                "; ".join(
                    ["no configuration of these options can be estimated", *search.notes[:1]]
                    + ([left_out] if left_out else [])
                )
            )
        fitting = [o for o in options if o.peak + margin <= budget]
        verified: dict[int, Estimate | None] = {}
        ranked = _verify(search, fitting, verified, budget, margin)
    found = [row for row in ranked if row[3] is not None]
    if not found:
        smallest = min([search.smallest, *search.verified_peaks])
        raise EffitrainError(
            f"nothing fits {_gib(budget)} per device: the smallest peak found is {_gib(smallest)}"
            f" + {_gib(margin)} margin, {_gib(smallest + margin - budget)} over"
            + (f"; {left_out}" if left_out else "")
        )
    best = _seconds(found[0][1], launch) or 0.0
    candidates = [_candidate(row, launch, best, command) for row in found[:SHOWN]]
    unverified = [row for row in ranked if row[3] is None][: SHOWN - len(candidates)]
    return PlanResult(
        budget_bytes=budget,
        margin_bytes=margin,
        device_type=launch.device_type,
        candidates=candidates,
        screened=len(options),
        estimates=search.runs,
        seconds=round(time.monotonic() - start, 1),
        notes=search.notes + ([left_out] if left_out else []),
        not_verified=[_candidate(row, launch, best, command) for row in unverified],
    )


def _longest(
    search: _Search,
    started: float,
    command: Callable[[dict[str, Any]], str],
    full_parameter: bool,
) -> PlanResult:
    """``plan(longest=True)``: the longest sequence that fits the search's budget per device, at
    micro-batch 1 (the config's batch is the global batch, reached by accumulation), with every
    lever of the search on (:meth:`_Search.every_lever`; adapters unless ``full_parameter``:
    they leave the least beside the activations), and its fastest candidates.

    The lengths are searched on the layer screens (:func:`effitrain.plan_lengths.
    longest_fitting`: the peak grows with the length), up to the longest sequence the run
    takes (:func:`effitrain.estimation.sequence_cap`). The length found is verified by a full
    estimate of its fastest candidate, in this process; where it does not fit, the length
    steps down by the verified excess over the screens' bytes per token.

    Raises:
        EffitrainError: nothing fits even at the shortest length tried.
    """
    from effitrain.estimation import LONGEST_TRIED, sequence_cap
    from effitrain.models import rotary_positions
    from effitrain.plan_lengths import SHORTEST, longest_fitting

    budget, launch = search.budget, search.launch
    room = budget - search.margin
    positions = cap = sequence_cap(search.config)
    if cap < LONGEST_TRIED and rotary_positions(search.config.model):
        cap = LONGEST_TRIED  # past the positions with --beyond-positions: see _longest_note
    with search:
        changes, reasons, full = search.every_lever(full_parameter)

        def at(length: int) -> dict[str, Any]:
            past = {"beyond_positions": True} if length > positions else {}
            return {**changes, "max_length": length, **past}

        def peak(length: int) -> int:
            screens = search.screens(at(length))
            return min([s.peak for s in screens.values()], default=2**63)

        found = longest_fitting(peak, room, cap)
        length = found.length
        if length is None:
            smallest = min(found.peaks.values())
            raise EffitrainError(
                f"nothing fits {_gib(budget)} per device even at {SHORTEST} tokens with every "
                f"lever of the search: the peak is {_gib(smallest)} + {_gib(search.margin)} "
                f"margin, {_gib(smallest + search.margin - budget)} over"
            )
        screened = length
        length, rows = _verified_longest(search, at, reasons, full, found, length)
    answers = [row for row in rows if row[3] is not None]
    if not answers:
        raise EffitrainError(
            f"nothing verified to fit {_gib(budget)} per device: the screens put the longest "
            f"at {screened:,} tokens, and full estimates at {length:,} still exceed it"
        )
    best = _seconds(answers[0][1], launch) or 0.0
    unverified = [row for row in rows if row[3] is None]
    notes = [_longest_note(length, screened, found, positions), *search.notes]
    left_out = search.missing_note()
    return PlanResult(
        budget_bytes=budget,
        margin_bytes=search.margin,
        device_type=launch.device_type,
        candidates=[_candidate(row, launch, best, command) for row in answers[:SHOWN]],
        screened=len(found.peaks),
        estimates=search.runs,
        seconds=round(time.monotonic() - started, 1),
        notes=notes + ([left_out] if left_out else []),
        not_verified=[_candidate(r, launch, best, command) for r in unverified][:SHOWN],
        longest=length,
    )


def _verified_longest(
    search: _Search,
    at: Callable[[int], dict[str, Any]],
    reasons: dict[str, str],
    full: bool,
    found: Found,
    length: int,
) -> tuple[int, list[tuple[Option, StepCost | None, int, Estimate | None]]]:
    """The screens' longest ``length`` verified by a full estimate of its fastest candidate;
    where it does not fit, stepped down (at most :data:`STEP_DOWNS` times) by the verified
    excess over the screens' bytes per token, a grid step at least. Returns the length last
    verified and its rows (none of them fitting where every step down failed)."""
    from effitrain.plan_lengths import SHORTEST, round_down, step_at

    room = search.budget - search.margin
    screened = length
    rows, verified = search.verified_at(at(length), reasons, full)
    for _ in range(STEP_DOWNS):
        if any(row[3] is not None for row in rows) or verified is None:
            break
        lower = length - (verified - room) // _per_token(found.peaks, screened)
        length = min(round_down(lower), length - step_at(length - 1))
        if length < SHORTEST:
            break
        rows, verified = search.verified_at(at(length), reasons, full)
    return length, rows


def _per_token(peaks: dict[int, int], length: int) -> int:
    """The peak's bytes per token at ``length``: the slope from the longest length tried below
    it (its average where none was)."""
    below = [other for other in peaks if other < length]
    if not below:
        return max(peaks[length] // length, 1)
    other = max(below)
    return max((peaks[length] - peaks[other]) // (length - other), 1)


def _longest_note(length: int, screened: int, found: Found, positions: int) -> str:
    """How the longest length was found, and what bounds it (``screened``: the longest the
    screens fit, where a full estimate stepped down from it; ``positions``: the longest the
    model takes without --beyond-positions)."""
    from effitrain.plan_lengths import COARSE_FROM, step_at

    if length == positions and found.over is None:
        return (
            f"{length:,} tokens is the longest sequence the model takes (its positions, or its "
            "tokenizer's model_max_length): the budget may have room for more"
        )
    where = f"from {COARSE_FROM:,} up" if length >= COARSE_FROM else f"below {COARSE_FROM:,}"
    if length < screened:
        bound = f"the screens fit {screened:,}, its full estimate did not"
    elif found.over:
        bound = f"{found.over:,} does not fit"
    else:
        bound = "the search goes no further"
    beyond = (
        f"; {length:,} tokens is beyond the model's {positions:,} positions: they are rotary "
        "(RoPE: computed for any index), but the model was not trained past them, so the "
        "commands say --beyond-positions (the run teaches them)"
        if length > positions
        else ""
    )
    return (
        f"the longest length was searched on the layer screens at {len(found.peaks)} lengths, "
        f"on multiples of {step_at(length):,} tokens ({where}): {bound}; every lever of the "
        f"search is on{beyond}"
    )


def _task(config: TrainConfig, launch: Launch) -> tuple[str, int]:
    """The run's task and the micro-batch every one of its micro-batches is a multiple of
    (``Task.batch_unit``), with the model's config read first (its one line where it cannot
    be: "no such folder", as ``effitrain estimate`` says), and the launch one a run can have.

    Raises:
        EffitrainError: the model or the task cannot be resolved, or the launch is one that
            ``effitrain train`` refuses on this device.
    """
    from effitrain.build import resolve_task
    from effitrain.models import is_preset, load_model_config

    if not is_preset(config.model):
        load_model_config(config.model)
    if launch.num_processes > 1 and launch.device_type == "cpu" and launch.strategy != "ddp":
        raise EffitrainError(
            f"--sharding {launch.strategy} runs on GPUs only (effitrain train refuses it on CPU "
            "processes): plan for GPUs with --device cuda, or use --sharding ddp"
        )
    task = resolve_task(config)
    return task.name, task.batch_unit(config)


def _candidate(
    row: tuple[Option, StepCost | None, int, Estimate | None],
    launch: Launch,
    best: float,
    command: Callable[[dict[str, Any]], str],
) -> PlanCandidate:
    """A ranked row as printed: its options, command, peak, cost and time relative to ``best``."""
    screened, cost, peak, verification = row
    seconds = _seconds(cost, launch)
    return PlanCandidate(
        args=to_arguments(screened.changes),
        command=command(screened.changes),
        optimizer=screened.changes["optim"],
        levers=screened.reasons,
        batch_size=screened.changes["batch_size"],
        grad_accum=screened.changes["grad_accum"],
        peak_tensor_bytes=peak,
        peak_phase=verification.memory.peak_phase if verification else screened.phase,
        # The host model's figure where an estimate verified it (screens do not model it).
        host_peak_bytes=_host_peak(verification),
        flops_per_step=cost.flops_per_step if cost is not None else None,
        step_seconds=seconds,
        relative_step_time=round(seconds / best, 3) if seconds and best else 1.0,
        full_parameter=screened.full_parameter,
        verified=verification is not None,
        optimizer_class=verification.optimizer_class if verification is not None else None,
    )


def _host_peak(verification: Estimate | None) -> int | None:
    if verification is None or verification.host is None:
        return None
    return verification.host.host_peak_bytes


def _verify(
    search: _Search,
    fitting: list[Option],
    verified: dict[int, Estimate | None],
    budget: int,
    margin: int,
) -> list[tuple[Option, StepCost | None, int, Estimate | None]]:
    """The fitting options ranked by modeled time, the first ``search.wanted`` (default
    :data:`VERIFIED`) by a full estimate each (those that do not fit once verified are dropped),
    re-ranked until the first ``search.wanted`` are all verified or :data:`MAX_VERIFICATIONS`
    estimates were made, and past that until one verified fits or none is left (each row: the
    option, its cost, its peak, and the estimate that verified it, if one did: only those are
    answers)."""
    while True:
        ranked: list[tuple[Option, StepCost | None, int, Estimate | None]] = []
        for index, screened in enumerate(fitting):
            if index in verified:
                result = verified[index]
                if result is None:
                    continue
                peak = device_peak(result)
                if peak + margin > budget:
                    continue
                ranked.append((screened, result.cost, peak, result))
            else:
                ranked.append((screened, screened.cost, screened.peak, None))
        ranked.sort(key=lambda row: (_seconds(row[1], search.launch) or 0.0, row[2]))
        todo = [fitting.index(row[0]) for row in ranked[: search.wanted] if row[3] is None]
        answered = any(row[3] is not None for row in ranked)
        if not todo or (answered and len(verified) >= MAX_VERIFICATIONS):
            return ranked
        # Workers side by side verify the next ones too where they would idle otherwise: a
        # candidate that drops out then costs no second round.
        spare = [fitting.index(row[0]) for row in ranked[search.wanted :] if row[3] is None]
        todo += spare[: -len(todo) % search.verifiers.parallel]
        todo = todo[: max(MAX_VERIFICATIONS - len(verified), search.verifiers.parallel)]
        for index, result in zip(todo, search.verify([fitting[i] for i in todo]), strict=True):
            verified[index] = result


class _Search:
    """The screened estimates of one plan (cached by lever set)."""

    def __init__(
        self,
        config: TrainConfig,
        launch: Launch,
        budget: int,
        optimizers: list[str],
        without: list[str],
        given: dict[str, Any],
        workers: int | None = None,
        worker_setup: Callable[[], None] | None = None,
        task: str = "",
        unit: int = 1,
        wanted: int = VERIFIED,
        optimizer_class: str | None = None,
    ) -> None:
        self.config = config
        self.given = given
        self.budget = budget
        self.margin = margin_bytes(budget, launch.device_type)
        self.launch = launch
        self.optimizers = optimizers
        self.without = set(without)
        self.runs = 0
        self.depth: int | None = None  # the model's layers, once a screen has cut them
        self.smallest = 2**63
        self.verified_peaks: list[int] = []
        self.notes: list[str] = []
        self._screens: dict[tuple[tuple[tuple[str, Any], ...], str], Screen | None] = {}
        self.left_out: dict[str, dict[str, list[str]]] = {}
        """Install line -> the options it would add -> the optimizers they were left out for."""
        self.task = task
        self.one_by_one = {"batch_size": unit, "grad_accum": 1}
        """The split every screen is estimated at: the task's smallest micro-batch."""
        self.global_batch = config.batch_size * config.grad_accum
        self.verifiers = Verifiers(launch, workers, worker_setup)
        self.wanted = wanted
        """The answers wanted: the walk stops once this many fit, and this many are verified."""
        self.optimizer_class = optimizer_class
        """Only configurations whose optimizer is of this class (None: any)."""

    def __enter__(self) -> _Search:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.verifiers.end(stopped=kind is not None)

    # -- the candidates ------------------------------------------------------------------------

    def options(self, full_parameter: bool) -> list[Option]:
        """Every screened candidate: per mode (full fine-tuning; LoRA adapters), the lever sets
        along :func:`_ladder`, each optimizer, each split of the global batch."""
        lora, search = _adapter_lever()
        user_adapters = lora.is_on(self.config)
        modes: list[tuple[dict[str, Any], bool]] = []
        if not user_adapters:
            modes.append(({}, True))
        if not full_parameter and lora.name not in self.without:
            rank = getattr(self.config, lora.fields[0]) if user_adapters else search.values[1]
            modes.append(({lora.fields[0]: rank}, False))
        if full_parameter and user_adapters:
            raise EffitrainError(
                f"--full-parameter contradicts {option(lora.fields[0])}; drop one of them"
            )
        out: list[Option] = []
        for base, full in modes:
            for name in self.optimizers:
                out += self._walk(base, full, name)
        return out

    def _walk(self, base: dict[str, Any], full: bool, name: str) -> list[Option]:
        """``name``'s options: levers added one at a time along :func:`_ladder` (a lever kept
        where it lowers ``name``'s peak), until enough of them fit (:meth:`_enough`). What a
        missing package rules out is left out, and noted (:meth:`_left_out_for_a_package`)."""
        if self._left_out_for_a_package(base, base, name):
            return []
        changes = dict(base)
        reasons = self._reasons(base)
        out: list[Option] = []
        latest: list[Option] = []
        screen = self._screen(changes, name)
        if screen is not None:
            latest = self._candidates(changes, reasons, full, screen, name)
            out += latest
        for lever, search, step in self._steps():
            if search.costs_time and self._enough(out, latest):
                break
            trial = {**changes, **step}
            if not self._worth_trying(lever, search, changes, screen):
                continue
            if self._left_out_for_a_package(trial, step, name):
                continue
            new = self._screen(trial, name)
            if new is None or (screen is not None and new.peak >= screen.peak):
                continue
            saved = f"{_gib(screen.peak - new.peak)} less at the peak" if screen else "fits"
            reasons = {**reasons, lever.name: f"{saved}: removes {lever.removes}"}
            changes, screen = trial, new
            latest = self._candidates(changes, reasons, full, screen, name)
            out += latest
        return out

    def _reasons(self, base: dict[str, Any]) -> dict[str, str]:
        """Why each lever of ``base`` (the mode: adapters or not) and of the user's options is
        in."""
        reasons = {}
        if base:
            lever, _ = _adapter_lever()
            reasons[lever.name] = (
                f"trains rank-{base[lever.fields[0]]} adapters: removes {lever.removes}"
            )
        for lever in lever_registry.active(self.config):
            if not lever.takes(self.task):
                continue
            how = "given" if any(f in self.given for f in lever.fields) else "on by default"
            reasons.setdefault(lever.name, f"{how}: removes {lever.removes}")
        return reasons

    # -- the longest length ------------------------------------------------------------------

    def every_lever(self, full_parameter: bool) -> tuple[dict[str, Any], dict[str, str], bool]:
        """The lever set of a longest-length search: adapters (unless ``full_parameter``, or
        left out), then each lever along :func:`_ladder` at its last search value where some
        optimizer runs it with those before (what a missing package rules out is noted). No
        screen decides: at the longest length each lever's bytes are worth a few more tokens.
        Returns the set, why each lever is in, and whether it trains every parameter."""
        lora, search = _adapter_lever()
        user_adapters = lora.is_on(self.config)
        if full_parameter and user_adapters:
            raise EffitrainError(
                f"--full-parameter contradicts {option(lora.fields[0])}; drop one of them"
            )
        full = not user_adapters and (full_parameter or lora.name in self.without)
        changes = {} if full or user_adapters else {lora.fields[0]: search.values[1]}
        reasons = self._reasons(changes)
        last = {lever.name: (lever, search, step) for lever, search, step in self._steps()}
        for lever, search, step in last.values():
            if self._worth_trying(lever, search, changes, None):
                changes = self._joined(changes, reasons, lever, step)
        return changes, reasons, full

    def _joined(
        self, changes: dict[str, Any], reasons: dict[str, str], lever: Lever, step: dict[str, Any]
    ) -> dict[str, Any]:
        """``changes`` with ``lever``'s ``step`` where some optimizer runs them (``reasons``
        says why it is in), else as they were."""
        trial = {**changes, **step}
        runs = [
            name
            for name in self.optimizers
            if not self._left_out_for_a_package(trial, step, name)
            and self._runs({**trial, "optim": name})
        ]
        if not runs:
            return changes
        reasons[lever.name] = f"on for the longest length: removes {lever.removes}"
        return trial

    def screens(self, changes: dict[str, Any]) -> dict[str, Screen]:
        """Each optimizer's screen of one lever set, where it runs it."""
        out = {}
        for name in self.optimizers:
            screen = self._screen(changes, name)
            if screen is not None:
                out[name] = screen
        return out

    def verified_at(
        self, changes: dict[str, Any], reasons: dict[str, str], full: bool
    ) -> tuple[list[tuple[Option, StepCost | None, int, Estimate | None]], int | None]:
        """One lever set's candidates (one per optimizer that runs it and split of the batch)
        that the screens fit, fastest first, the first (as many as verify side by side)
        verified by a full estimate (rows as :func:`_verify` makes them; one verified not to
        fit is dropped). Returns the rows and the smallest verified peak (None: none
        verified)."""
        options = []
        for name, screen in self.screens(changes).items():
            options += self._candidates(changes, reasons, full, screen, name)
        fitting = [o for o in options if self._fits(o.peak)]
        fitting.sort(key=lambda o: (_seconds(o.cost, self.launch) or 0.0, o.peak))
        first = fitting[: self.verifiers.parallel]
        rows: list[tuple[Option, StepCost | None, int, Estimate | None]] = []
        smallest = None
        for screened, result in zip(first, self.verify(first), strict=True):
            if result is None:
                continue
            peak = device_peak(result)
            smallest = peak if smallest is None else min(smallest, peak)
            if self._fits(peak):
                rows.append((screened, result.cost, peak, result))
        rows += [(o, o.cost, o.peak, None) for o in fitting[len(first) :]]
        return rows, smallest

    def _left_out_for_a_package(
        self, values: dict[str, Any], added: dict[str, Any], name: str
    ) -> bool:
        """Whether ``values`` with optimizer ``name`` need a package that is not installed; if
        so, and the checks take them otherwise, ``added`` (what they add to the search) is noted
        against its install line (:meth:`missing_note`)."""
        install = self._missing({**values, "optim": name})
        if not install:
            return False
        if self._valid({**values, "optim": name, **self.one_by_one}, missing_ok=True):
            what = shlex.join(to_arguments(added))
            self.left_out.setdefault(install, {}).setdefault(what, []).append(name)
        return True

    def missing_note(self) -> str:
        """What installing each missing package would add to the search ("" where none is)."""
        parts = []
        for install, sets in self.left_out.items():
            added = [
                f"{what} with {', '.join(names)}" if what else f"--optim {', '.join(names)}"
                for what, names in sets.items()
            ]
            parts.append(f"{install} would add {'; '.join(added)}")
        return "not tried for want of a package: " + "; ".join(parts) if parts else ""

    def _missing(self, values: dict[str, Any]) -> str | None:
        """What to install for ``values`` to run (a lever's package, the optimizer's or its
        bf16 variant's), else None."""
        from effitrain.build import resolve_optimizer_spec

        config = dataclasses.replace(self.config, **values)
        for lever in lever_registry.active(config):
            install = lever.missing_install()
            if install:
                return " ".join(install.split())
        try:
            spec = resolve_optimizer_spec(config, self.launch)
        except EffitrainError:  # refused: the checks say so
            return None
        return None if spec.is_available() else " ".join(spec.install.split())

    def _worth_trying(
        self, lever: Lever, search: Search, changes: dict[str, Any], screen: Screen | None
    ) -> bool:
        """Not a lever that is on already (unless its search steps on from there: the offload's
        next value), nor one that removes only gradients and state where those are small
        (:data:`SMALL_SHARE`)."""
        on = lever.is_on(dataclasses.replace(self.config, **changes))
        if on and not search.steps_when_on:
            return False
        if search.removes_only_update and screen is not None:
            return screen.static - screen.parameters >= SMALL_SHARE * screen.peak
        return True

    def _enough(self, options: list[Option], latest: list[Option]) -> bool:
        """Whether ``wanted`` options fit already, or every one of the latest lever set:
        a further lever would only add time (the ladder's order; those that cost no time,
        ``Search.costs_time``, excepted)."""
        if latest and all(self._fits(o.peak) for o in latest):
            return True
        return sum(self._fits(o.peak) for o in options) >= self.wanted

    def _fits(self, peak: int) -> bool:
        return peak + self.margin <= self.budget

    def _steps(self) -> Iterator[tuple[Lever, Search, dict[str, Any]]]:
        for lever, search in _ladder():
            if lever.name in self.without or not lever.takes(self.task):
                continue
            if lever.devices and self.launch.device_type not in lever.devices:
                continue
            for value in search.values[1:]:
                yield lever, search, {lever.fields[0]: value}

    def _candidates(
        self,
        changes: dict[str, Any],
        reasons: dict[str, str],
        full: bool,
        screen: Screen,
        name: str,
    ) -> list[Option]:
        """One option per split of the batch that optimizer ``name`` takes with these levers
        (``screen``: ``name``'s, at the screens' micro-batch)."""
        out = []
        unit = self.one_by_one["batch_size"]
        for micro in _divisors(self.global_batch):
            split = {"batch_size": micro, "grad_accum": self.global_batch // micro}
            values = {**changes, "optim": name, **split}
            if micro % unit or not self._valid(values):
                continue
            peak = screen.peak_at(micro // unit)
            self.smallest = min(self.smallest, peak)
            cost = _scaled(screen.cost, micro, self.global_batch, values, self.config, unit)
            phase = screen.peak_phase(micro // unit)
            out.append(Option(values, dict(reasons), full, peak, cost, phase))
        return out

    def _state(self, screen: Screen, reference: str, name: str) -> int | None:
        """``name``'s state where the screen measured ``reference``'s: the measured bytes
        scaled by their bytes per parameter (which carries the state's dtype and the launch's
        split), or, beside a reference of almost no state, the bytes per parameter alone (None:
        not measured for ``name``)."""
        from effitrain.optim import state_bytes_per_param

        if name == reference:
            return screen.state
        per_param, ref_bytes = state_bytes_per_param(name), state_bytes_per_param(reference)
        if per_param is None:
            return None
        if ref_bytes is not None and ref_bytes >= 1:
            return int(screen.state * per_param / ref_bytes)
        return int(screen.trainable * per_param / self._state_split())

    def _state_split(self) -> int:
        sharded = "optimizer_state" in SHARDED.get(self.launch.strategy, ())
        return self.launch.num_processes if sharded else 1

    def _reference(self, changes: dict[str, Any], name: str) -> str:
        """The optimizer ``name``'s screen of a lever set is estimated with: of those that
        run it (installed, taken by the checks) and have measured bytes per parameter, the one
        with the most state (the others' is scaled from it: one estimate serves them all);
        ``name`` itself where its bytes were not measured."""
        from effitrain.optim import state_bytes_per_param

        if state_bytes_per_param(name) is None:
            return name
        usable = [
            n
            for n in self.optimizers
            if state_bytes_per_param(n) is not None and self._runs({**changes, "optim": n})
        ]
        return max(usable, key=lambda n: state_bytes_per_param(n) or 0.0, default=name)

    def _runs(self, values: dict[str, Any]) -> bool:
        """Whether ``values`` (at micro-batch 1) are installed and taken by the checks."""
        return self._missing(values) is None and self._valid({**values, **self.one_by_one})

    def _valid(self, values: dict[str, Any], missing_ok: bool = False) -> bool:
        """Whether the checks take ``values`` (``missing_ok``: all but a missing package)."""
        try:
            self._config(values)
        except MissingPackage:
            return missing_ok
        except EffitrainError:
            return False
        return True

    def _config(self, values: dict[str, Any]) -> TrainConfig:
        config = dataclasses.replace(self.config, **values).validate()
        check_config(config)
        check_launch(config, self.launch)
        if self.optimizer_class is not None:
            spec = resolve_optimizer_spec(config, self.launch)
            if spec.class_path != self.optimizer_class:
                raise EffitrainError(f"{spec.class_path}, not {self.optimizer_class}")
        return config

    # -- estimates -----------------------------------------------------------------------------

    def _screen(self, changes: dict[str, Any], name: str) -> Screen | None:
        """Optimizer ``name``'s figures for a lever set at micro-batch 1: the estimate of its
        reference optimizer (:meth:`_reference`, else ``name``'s own), its state scaled to
        ``name``'s (None: ``name`` does not run it, or it cannot be estimated)."""
        if not self._runs({**changes, "optim": name}):
            return None
        for reference in dict.fromkeys([self._reference(changes, name), name]):
            screen = self._measured(changes, reference)
            if screen is not None:
                state = self._state(screen, reference, name)
                if state is None:
                    return None
                change = state - screen.state
                phases = screen.phases
                return dataclasses.replace(
                    screen,
                    peak=screen.peak + change,
                    static=screen.static + change,
                    state=state,
                    phases=(phases[0] + change, phases[1] + change) if phases else None,
                )
        return None

    def _measured(self, changes: dict[str, Any], reference: str) -> Screen | None:
        """A lever set's estimate with ``reference`` at micro-batch 1, the model cut to one
        and two layers and extended to its depth (None: it cannot be estimated)."""
        key = (tuple(sorted(changes.items())), reference)
        if key in self._screens:
            return self._screens[key]
        screen = None
        values = {**changes, "optim": reference, **self.one_by_one}
        try:
            screen = self._extended(self._config(values))
        except EffitrainError as exc:
            self.notes.append(f"skipped {shlex.join(to_arguments(values))}: {exc}")
        self._screens[key] = screen
        return screen

    def _extended(self, config: TrainConfig) -> Screen:
        """The one- and two-layer estimates, extended to the model's depth; once a screen has
        found the model at most two layers deep, its two-layer estimate alone: the model whole."""
        points = []
        for layers in (1, 2) if self.depth is None or self.depth > 2 else (2,):
            started = time.monotonic()
            with cut_to(layers) as seen:
                points.append(screen_of(estimate(config, self.launch)))
                self.runs += 1
            self.depth = seen.get("layers")
            if self.depth is None:  # the model has no layer count to cut: estimated whole
                return points[0]
        depth = self.depth
        assert depth is not None  # each pass returned where it was None
        self.verifiers.start(config, (time.monotonic() - started) * depth / 2, VERIFIED)
        return extend(points[0], points[-1], depth) if len(points) == 2 else points[0]

    def verify(self, options: list[Option]) -> list[Estimate | None]:
        """Each option's full estimate (None where it cannot be estimated), in the verifying
        worker processes where they were started."""
        outcomes = self.verifiers.estimates([self._config(o.changes) for o in options])
        results: list[Estimate | None] = []
        for outcome in outcomes:
            if isinstance(outcome, str):
                self.notes.append(f"not verified ({outcome})")
                results.append(None)
                continue
            self.runs += 1
            self.verified_peaks.append(device_peak(outcome))
            results.append(outcome)
        return results


# -- helpers ---------------------------------------------------------------------------------


def _scaled(
    cost: StepCost | None,
    micro: int,
    batch: int,
    values: dict[str, Any],
    config: TrainConfig,
    unit: int = 1,
) -> StepCost | None:
    """A step's cost at micro-batch ``unit`` as one optimizer step of ``batch`` examples in
    micro-batches of ``micro``: the FLOPs and bytes of ``batch`` examples, the operator calls
    of ``batch / micro`` micro-batches, the activations' offload per example."""
    if cost is None:
        return None
    batch //= unit  # in the screen's micro-batches
    per_example = any(
        lever.search is not None and lever.search.offload_per_example
        for lever in lever_registry.active(dataclasses.replace(config, **values))
    )
    return dataclasses.replace(
        cost,
        flops_per_step=cost.flops_per_step * batch,
        recompute_flops=cost.recompute_flops * batch,
        half_precision_flops=cost.half_precision_flops * batch,
        elementwise_bytes=cost.elementwise_bytes * batch,
        operator_calls=cost.operator_calls * batch * unit // micro,
        offload_bytes_per_step=cost.offload_bytes_per_step * (batch if per_example else 1),
    )


def _seconds(cost: StepCost | None, launch: Launch) -> float | None:
    return modeled_step_seconds(cost, launch.device_type) if cost is not None else None


def _divisors(n: int) -> list[int]:
    """The micro-batch sizes that split ``n`` evenly, largest first."""
    return [m for m in range(n, 0, -1) if n % m == 0]


def _command(
    launch: Launch, config_file: str | None, given: dict[str, Any], changes: dict[str, Any]
) -> str:
    """``effitrain train`` with the user's options and the plan's (under ``accelerate launch``
    for several processes, :func:`launch_arguments`), spelled by the option table."""
    base = ["--config", str(config_file)] if config_file else []
    base += to_arguments({k: v for k, v in given.items() if k not in changes})
    prefix = ["effitrain", "train"]
    if launch.num_processes > 1:
        prefix = [*launch_arguments(launch, changes["grad_accum"]), "-m", *prefix]
    return shlex.join([*prefix, *base, *to_arguments(changes)])


def launch_arguments(launch: Launch, grad_accum: int) -> list[str]:
    """``accelerate launch`` with the flags that make ``launch`` (no config file: an installed
    effitrain has no configs/ folder): DDP (CPU processes over gloo with ACCELERATE_USE_CPU=1),
    FSDP2 full shard wrapped per transformer block, as configs/accelerate/fsdp2-full-shard.yaml,
    or DeepSpeed's ZeRO stage with the run's accumulation."""
    processes = ["--num_processes", str(launch.num_processes)]
    if launch.strategy == "fsdp":
        return ["accelerate", "launch", *processes, *FSDP2_FLAGS]
    if launch.strategy.startswith("zero"):
        stage = launch.strategy.removeprefix("zero")
        deepspeed = ["--use_deepspeed", "--zero_stage", stage]
        return ["accelerate", "launch", *processes, *deepspeed,
                "--gradient_accumulation_steps", str(grad_accum)]  # fmt: skip
    ddp = ["accelerate", "launch", "--multi_gpu", *processes]
    return ["ACCELERATE_USE_CPU=1", *ddp] if launch.device_type == "cpu" else ddp


FSDP2_FLAGS = (
    *("--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "true"),
    *("--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
    *("--fsdp_state_dict_type", "SHARDED_STATE_DICT"),
)
"""``accelerate launch``'s flags for what ``effitrain estimate --sharding fsdp`` models: FSDP2,
parameters resharded after forward, one unit per block (the model's ``_no_split_modules``)."""


def _gib(nbytes: int) -> str:
    from effitrain.memory.ledger import format_bytes

    return format_bytes(nbytes)
