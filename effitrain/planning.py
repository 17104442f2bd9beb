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
  at any width) and extended to the model's depth along that line.
- **Levers, one at a time.** From the user's configuration, levers are added in the order of
  their time cost (:data:`LADDER`: the cheapest first), each kept only where it lowers the peak;
  every configuration on the way is a candidate, in full fine-tuning and with LoRA adapters.
- **Optimizers.** One is estimated per lever set (the one with the most state); the others'
  state is its measured state scaled by their measured bytes per parameter
  (``effitrain/optim/state_bytes.json``).
- **Micro-batches.** Estimated at micro-batch 1; a micro-batch of m holds the parameters,
  gradients and state once and m times the rest of the peak (an upper bound: the rest is
  activations and the step's working tensors, at most proportional to the tokens).

Those are screens, not results: the candidates that rank first are **verified** by a full
estimate of the exact configuration, and the ranking uses the verified figures (a candidate
that does not fit once verified is dropped) until the first :data:`VERIFIED` all are.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import effitrain.levers as lever_registry
from effitrain.build import check_config, check_launch
from effitrain.config import TrainConfig, option, to_arguments
from effitrain.cost import StepCost, modeled_step_seconds
from effitrain.distributed import Launch
from effitrain.errors import EffitrainError
from effitrain.estimation import SHARDED, estimate
from effitrain.results import Estimate, PlanCandidate, PlanResult

DEFAULT_OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor")
"""What a plan tries without ``--optim``: full state, 8-bit state, factored state."""
LADDER = (
    "optimizer-in-backward",
    "bf16-weights",
    "chunked-loss",
    "gradient-checkpointing",
    "load-in-4bit",
    "activation-offload",
    "optimizer-offload",
)
"""The order levers are added in, cheapest in time first (their ``time_cost``; the step in
backward costs nothing measurable, bf16 weights speed a GPU up, the offloads are bound by the
host link). Each is tried at its ``search`` values after the first (off) one."""
FASTER = ("optimizer-in-backward", "bf16-weights")
"""Levers tried even where enough fits without them: they cost no time (the step in backward) or
save it (bf16 matmuls), so a configuration with them may be the fastest."""
ADAPTER_LEVER = "lora"
UPDATE_LEVERS = ("optimizer-in-backward", "optimizer-offload")
"""Levers that remove only gradients and optimizer state: not tried where those are under
:data:`SMALL_SHARE` of the peak (LoRA's adapters)."""
SMALL_SHARE = 0.02
VERIFIED = 3
"""Candidates verified by a full estimate: at least the first this many printed."""
MAX_VERIFICATIONS = 8
"""Full estimates at most per plan (each takes seconds on a large model)."""
PARALLEL_FROM_SECONDS = 3.0
"""Verifications run in worker processes, side by side, where one is expected to take longer
than this (the two-layer screen's time times half the depth): a worker's imports and first
estimate take about as long, paid while the plan screens."""
SHOWN = 10
"""Candidates kept in the result, best first."""
LAYER_FIELDS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
"""Where a transformers config keeps its number of layers."""
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


@dataclasses.dataclass(frozen=True)
class Screen:
    """A lever set's estimate at micro-batch 1 with its reference optimizer, at full depth."""

    peak: int
    static: int
    """Parameters, gradients and optimizer state (per device): what the batch does not change."""
    state: int
    parameters: int
    trainable: int
    cost: StepCost | None


@dataclasses.dataclass(frozen=True)
class Option:
    """One screened candidate before verification."""

    changes: dict[str, Any]
    """The config fields the plan sets (optimizer, levers, batch split)."""
    reasons: dict[str, str]
    full_parameter: bool
    peak: int
    cost: StepCost | None


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
) -> PlanResult:
    """The configurations of ``config`` that fit ``budget`` bytes per device on ``launch``,
    fastest first by modeled step time. ``given`` and ``config_file``: the options the user
    gave (each printed command starts with them, less those the plan sets). ``workers``:
    processes that verify side by side (None: one per core, up to :data:`VERIFIED`, where a
    verification is slow, see :data:`PARALLEL_FROM_SECONDS`; 0: verified in this process),
    each first calling ``worker_setup`` (a module-level function: the CLI's quieting).

    Raises:
        EffitrainError: bad options, or nothing fits (the message names the smallest peak).
    """
    start = time.monotonic()
    config = dataclasses.replace(config, max_memory=None)  # the steps, as a plain run takes them
    for name in without:
        lever_registry.get_lever(name)
    names = list(optimizers or DEFAULT_OPTIMIZERS)
    from effitrain.optim import get_spec

    for name in names:
        get_spec(name)
    search = _Search(config, launch, budget, names, without, given or {}, workers, worker_setup)
    margin = search.margin
    with search:
        options = search.options(full_parameter)
        if not options:
            raise EffitrainError(
                "no configuration of these options can be estimated; see `effitrain estimate`"
            )
        fitting = [o for o in options if o.peak + margin <= budget]
        verified: dict[int, Estimate | None] = {}
        ranked = _verify(search, fitting, verified, budget, margin)
    if not ranked:
        smallest = min([search.smallest, *search.verified_peaks])
        raise EffitrainError(
            f"nothing fits {_gib(budget)} per device: the smallest peak found is {_gib(smallest)}"
            f" + {_gib(margin)} margin, {_gib(smallest + margin - budget)} over"
        )
    best = _seconds(ranked[0][1], launch) or 0.0
    command = functools.partial(_command, launch, config_file, given or {})
    candidates = [_candidate(row, launch, best, command) for row in ranked[:SHOWN]]
    return PlanResult(
        budget_bytes=budget,
        margin_bytes=margin,
        device_type=launch.device_type,
        candidates=candidates,
        screened=len(options),
        estimates=search.runs,
        seconds=round(time.monotonic() - start, 1),
        notes=search.notes,
    )


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
        # The host model's figure where an estimate verified it (screens do not model it).
        host_peak_bytes=_host_peak(verification),
        flops_per_step=cost.flops_per_step if cost is not None else None,
        step_seconds=seconds,
        relative_step_time=round(seconds / best, 3) if seconds and best else 1.0,
        full_parameter=screened.full_parameter,
        verified=verification is not None,
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
    """The fitting options ranked by modeled time, the first :data:`VERIFIED` by a full
    estimate each (those that do not fit once verified are dropped), re-ranked until the first
    :data:`VERIFIED` are all verified or :data:`MAX_VERIFICATIONS` estimates were made (each row:
    the option, its cost, its peak, and the estimate that verified it, if one did)."""
    while True:
        ranked = []
        for index, screened in enumerate(fitting):
            if index in verified:
                result = verified[index]
                if result is None:
                    continue
                peak = _device_peak(result)
                if peak + margin > budget:
                    continue
                ranked.append((screened, result.cost, peak, result))
            else:
                ranked.append((screened, screened.cost, screened.peak, None))
        ranked.sort(key=lambda row: (_seconds(row[1], search.launch) or 0.0, row[2]))
        todo = [fitting.index(row[0]) for row in ranked[:VERIFIED] if row[3] is None]
        if not todo or len(verified) >= MAX_VERIFICATIONS:
            return ranked
        # Workers side by side verify the next ones too where they would idle otherwise: a
        # candidate that drops out then costs no second round.
        spare = [fitting.index(row[0]) for row in ranked[VERIFIED:] if row[3] is None]
        todo += spare[: -len(todo) % search.parallel]
        todo = todo[: MAX_VERIFICATIONS - len(verified)]
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
    ) -> None:
        self.config = config
        self.given = given
        self.budget = budget
        self.margin = margin_bytes(budget, launch.device_type)
        self.launch = launch
        self.optimizers = optimizers
        self.without = set(without)
        self.runs = 0
        self.smallest = 2**63
        self.verified_peaks: list[int] = []
        self.notes: list[str] = []
        self._screens: dict[tuple[tuple[str, Any], ...], Screen | None] = {}
        self.global_batch = config.batch_size * config.grad_accum
        self.workers = workers
        self.worker_setup = worker_setup
        self._pool: Any = None
        self._pool_size = 0

    def __enter__(self) -> _Search:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- the candidates ------------------------------------------------------------------------

    def options(self, full_parameter: bool) -> list[Option]:
        """Every screened candidate: per mode (full fine-tuning; LoRA adapters), the lever sets
        along :data:`LADDER`, each optimizer, each split of the global batch."""
        lora = lever_registry.get_lever(ADAPTER_LEVER)
        user_adapters = lora.is_on(self.config)
        modes = []
        if not user_adapters:
            modes.append(({}, True))
        if not full_parameter and ADAPTER_LEVER not in self.without:
            rank = getattr(self.config, lora.fields[0]) if user_adapters else lora.search[1]
            modes.append(({lora.fields[0]: rank}, False))
        if full_parameter and user_adapters:
            raise EffitrainError(
                f"--full-parameter contradicts {option(lora.fields[0])}; drop one of them"
            )
        out: list[Option] = []
        for base, full in modes:
            out += self._walk(base, full)
        return out

    def _walk(self, base: dict[str, Any], full: bool) -> list[Option]:
        """Levers added one at a time along :data:`LADDER` (a lever kept where it lowers the
        peak), until enough options fit (:meth:`_enough`)."""
        changes = dict(base)
        reasons = {}
        if base:
            lever = lever_registry.get_lever(ADAPTER_LEVER)
            reasons[lever.name] = (
                f"trains rank-{base[lever.fields[0]]} adapters: removes {lever.removes}"
            )
        for lever in lever_registry.active(self.config):
            how = "given" if any(f in self.given for f in lever.fields) else "on by default"
            reasons.setdefault(lever.name, f"{how}: removes {lever.removes}")
        out: list[Option] = []
        latest: list[Option] = []
        screen = self._screen(changes)
        if screen is not None:
            latest = self._candidates(changes, reasons, full, screen)
            out += latest
        for step in self._steps():
            if step[0].name not in FASTER and self._enough(out, latest):
                break
            lever, trial = step[0], {**changes, **step[1]}
            if not self._worth_trying(lever, changes, screen):
                continue
            new = self._screen(trial)
            if new is None or (screen is not None and new.peak >= screen.peak):
                continue
            saved = f"{_gib(screen.peak - new.peak)} less at the peak" if screen else "fits"
            reasons = {**reasons, lever.name: f"{saved}: removes {lever.removes}"}
            changes, screen = trial, new
            latest = self._candidates(changes, reasons, full, screen)
            out += latest
        return out

    def _worth_trying(self, lever: Any, changes: dict[str, Any], screen: Screen | None) -> bool:
        """Not a lever that is on already (the offload's next value excepted), nor one that
        removes only gradients and state where those are small (:data:`UPDATE_LEVERS`)."""
        on = lever.is_on(dataclasses.replace(self.config, **changes))
        if on and lever.name != "optimizer-offload":
            return False
        if lever.name in UPDATE_LEVERS and screen is not None:
            return screen.static - screen.parameters >= SMALL_SHARE * screen.peak
        return True

    def _enough(self, options: list[Option], latest: list[Option]) -> bool:
        """Whether :data:`VERIFIED` options fit already, or every one of the latest lever set:
        a further lever would only add time (the ladder's order; :data:`FASTER` excepted)."""
        if latest and all(self._fits(o.peak) for o in latest):
            return True
        return sum(self._fits(o.peak) for o in options) >= VERIFIED

    def _fits(self, peak: int) -> bool:
        return peak + self.margin <= self.budget

    def _steps(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        for name in LADDER:
            lever = lever_registry.LEVERS[name]
            if name in self.without or not lever.search:
                continue
            if lever.devices and self.launch.device_type not in lever.devices:
                continue
            for value in lever.search[1:]:
                yield lever, {lever.fields[0]: value}

    def _candidates(
        self, changes: dict[str, Any], reasons: dict[str, str], full: bool, screen: Screen
    ) -> list[Option]:
        """One option per optimizer that takes these levers and split of the batch."""
        out = []
        reference = self._reference(changes)
        for name in self.optimizers:
            state = self._state(screen, reference, name)
            if state is None:
                continue
            static = screen.static - screen.state + state
            dynamic = max(screen.peak - screen.static, 0)
            for micro in _divisors(self.global_batch):
                split = {"batch_size": micro, "grad_accum": self.global_batch // micro}
                values = {**changes, "optim": name, **split}
                if not self._valid(values):
                    continue
                peak = static + micro * dynamic
                self.smallest = min(self.smallest, peak)
                out.append(
                    Option(
                        values,
                        dict(reasons),
                        full,
                        peak,
                        _scaled(screen.cost, micro, self.global_batch, values, self.config),
                    )
                )
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

    def _reference(self, changes: dict[str, Any]) -> str:
        """The optimizer a lever set is estimated with: of those that take it, the one with the
        most state (the others' is scaled from it)."""
        from effitrain.optim import state_bytes_per_param

        usable = [
            n
            for n in self.optimizers
            if self._valid({**changes, "optim": n, "batch_size": 1, "grad_accum": 1})
        ]
        return max(usable, key=lambda n: state_bytes_per_param(n) or 0.0) if usable else ""

    def _valid(self, values: dict[str, Any]) -> bool:
        try:
            self._config(values)
        except EffitrainError:
            return False
        return True

    def _config(self, values: dict[str, Any]) -> TrainConfig:
        config = dataclasses.replace(self.config, **values).validate()
        check_config(config)
        check_launch(config, self.launch)
        return config

    # -- estimates -----------------------------------------------------------------------------

    def _screen(self, changes: dict[str, Any]) -> Screen | None:
        """A lever set's estimate at micro-batch 1, the model cut to one and two layers and
        extended to its depth (None: no optimizer takes it, or it cannot be estimated)."""
        key = tuple(sorted(changes.items()))
        if key in self._screens:
            return self._screens[key]
        reference = self._reference(changes)
        screen = None
        if reference:
            config = self._config({**changes, "optim": reference, "batch_size": 1, "grad_accum": 1})
            try:
                screen = self._extended(config)
            except EffitrainError as exc:
                self.notes.append(f"skipped {shlex.join(to_arguments(changes))}: {exc}")
        self._screens[key] = screen
        return screen

    def _extended(self, config: TrainConfig) -> Screen:
        points = []
        depth = None
        for layers in (1, 2):
            started = time.monotonic()
            with _cut_to(layers) as seen:
                points.append(_screen_of(estimate(config, self.launch)))
                self.runs += 1
            depth = seen.get("layers")
            if depth is None:  # the model has no layer count to cut: estimated whole
                return points[0]
        self._start_workers(config, (time.monotonic() - started) * depth / 2)
        return _extend(points[0], points[1], depth)

    def _start_workers(self, config: TrainConfig, verify_seconds: float) -> None:
        """Start the verifying processes (once) where a verification looks slow; they import
        and warm up while the plan goes on screening."""
        if self._pool is not None or self.workers == 0:
            return
        count = self.workers
        if count is None:
            if verify_seconds < PARALLEL_FROM_SECONDS:
                return
            count = min(VERIFIED, _cores())
        if count < 2:
            return
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        # spawn: a fork would copy this process's threads and locks mid-flight.
        self._pool_size = count
        self._pool = ProcessPoolExecutor(
            count,
            mp_context=get_context("spawn"),
            initializer=_warm,
            initargs=(config, self.launch, self.worker_setup),
        )

    @property
    def parallel(self) -> int:
        """How many verifications run at once."""
        return self._pool_size if self._pool is not None else 1

    def verify(self, options: list[Option]) -> list[Estimate | None]:
        """Each option's full estimate (None where it cannot be estimated), in worker processes
        where they were started (the same function: the same figures)."""
        configs = [self._config(o.changes) for o in options]
        if self._pool is not None and len(configs) > 1:
            from concurrent.futures.process import BrokenProcessPool

            futures = [self._pool.submit(_verified, c, self.launch) for c in configs]
            try:
                outcomes = [f.result() for f in futures]
            except BrokenProcessPool:  # a worker died (memory?): verify here instead
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
                outcomes = [_verified(c, self.launch) for c in configs]
        else:
            outcomes = [_verified(c, self.launch) for c in configs]
        results: list[Estimate | None] = []
        for outcome in outcomes:
            if isinstance(outcome, str):
                self.notes.append(f"not verified ({outcome})")
                results.append(None)
                continue
            self.runs += 1
            self.verified_peaks.append(_device_peak(outcome))
            results.append(outcome)
        return results


# -- helpers ---------------------------------------------------------------------------------


def _verified(config: TrainConfig, launch: Launch) -> Estimate | str:
    """A full estimate, or why it could not be made (one line: it crosses processes)."""
    try:
        return estimate(config, launch)
    except EffitrainError as exc:
        return str(exc)


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _warm(config: TrainConfig, launch: Launch, setup: Callable[[], None] | None) -> None:
    """A verifying worker's start: ``setup``, its imports and a one-layer estimate (fake
    tensors keep a cache of shapes per process)."""
    if setup is not None:
        setup()
    with suppress(Exception), _cut_to(1):
        estimate(config, launch)


def _device_peak(result: Estimate) -> int:
    if result.per_device is not None and result.per_device.peak_tensor_bytes is not None:
        return result.per_device.peak_tensor_bytes
    return result.memory.peak_tensor_bytes or 0


def _screen_of(result: Estimate) -> Screen:
    memory = result.memory
    per = result.per_device
    if per is not None:
        state = per.optimizer_state_bytes
        static = per.parameter_bytes + per.gradient_bytes + state
    else:
        state = memory.optimizer_state.bytes
        static = memory.parameter_bytes + memory.gradient_bytes + state
    parameters = per.parameter_bytes if per is not None else memory.parameter_bytes
    return Screen(
        _device_peak(result), static, state, parameters, memory.trainable_parameters, result.cost
    )


def _extend(one: Screen, two: Screen, depth: int) -> Screen:
    """The line through the one- and two-layer figures, at ``depth`` layers."""

    def at(a: int, b: int) -> int:
        return max(int(a + (b - a) * (depth - 1)), 0)

    cost = None
    if one.cost is not None and two.cost is not None:
        first, second = one.cost.to_dict(), two.cost.to_dict()
        cost = StepCost(**{k: at(first[k], second[k]) for k in first})
    return Screen(
        peak=at(one.peak, two.peak),
        static=at(one.static, two.static),
        state=at(one.state, two.state),
        parameters=at(one.parameters, two.parameters),
        trainable=at(one.trainable, two.trainable),
        cost=cost,
    )


@contextmanager
def _cut_to(layers: int) -> Iterator[dict[str, int]]:
    """Models built from a config inside it have at most ``layers`` layers; the dict it gives
    gets the config's own count (``layers``) when one was cut."""
    from unittest import mock

    import transformers

    seen: dict[str, int] = {}

    def cutting(original: Any) -> Any:
        def from_config(model_config: Any, *args: Any, **kwargs: Any) -> Any:
            model_config = copy.deepcopy(model_config)
            for name in LAYER_FIELDS:
                count = getattr(model_config, name, None)
                if isinstance(count, int) and count > 0:
                    seen["layers"] = count
                    setattr(model_config, name, min(count, layers))
                    kinds = getattr(model_config, "layer_types", None)
                    if isinstance(kinds, list):
                        model_config.layer_types = kinds[:layers]
                    break
            return original(model_config, *args, **kwargs)

        return from_config

    with ExitStack() as stack:
        for auto in (
            transformers.AutoModelForCausalLM,
            transformers.AutoModelForSequenceClassification,
        ):
            stack.enter_context(mock.patch.object(auto, "from_config", cutting(auto.from_config)))
        yield seen


def _scaled(
    cost: StepCost | None, micro: int, batch: int, values: dict[str, Any], config: TrainConfig
) -> StepCost | None:
    """A micro-batch-1 step's cost as one optimizer step of ``batch`` examples in micro-batches
    of ``micro``: the FLOPs and bytes of ``batch`` examples, the operator calls of
    ``batch / micro`` micro-batches, the activations' offload per example."""
    if cost is None:
        return None
    activation_offload = lever_registry.get_lever("activation-offload")
    per_example = activation_offload.is_on(dataclasses.replace(config, **values))
    return dataclasses.replace(
        cost,
        flops_per_step=cost.flops_per_step * batch,
        recompute_flops=cost.recompute_flops * batch,
        half_precision_flops=cost.half_precision_flops * batch,
        elementwise_bytes=cost.elementwise_bytes * batch,
        operator_calls=cost.operator_calls * batch // micro,
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
    for several processes), spelled by the option table."""
    base = ["--config", str(config_file)] if config_file else []
    base += to_arguments({k: v for k, v in given.items() if k not in changes})
    prefix = ["effitrain", "train"]
    if launch.num_processes > 1:
        prefix = [
            "accelerate",
            "launch",
            "--num_processes",
            str(launch.num_processes),
            "-m",
            *prefix,
        ]
    return shlex.join([*prefix, *base, *to_arguments(changes)])


def _gib(nbytes: int) -> str:
    from effitrain.memory.ledger import format_bytes

    return format_bytes(nbytes)


# -- train --max-memory ------------------------------------------------------------------------

QUICK_PLAN_BYTES = 2**29
"""A refused run gets the plan's best configuration where its parameters are at most this many
bytes (the plan then takes seconds); a larger one gets the plan's command to run."""


def check_budget(config: TrainConfig, launch: Launch, budget: int) -> int:
    """``effitrain train --max-memory``: the run's estimate, before any weight is read, against
    ``budget`` with the plan's margin. Returns the estimated peak per device.

    Raises:
        EffitrainError: it will not fit: one line with the overshoot and what fits instead.
    """
    text = config.max_memory or _gib(budget).replace(" ", "")
    config = dataclasses.replace(config, max_memory=None)  # the steps, as a plain run takes them
    result = estimate(config, launch)
    peak = _device_peak(result)
    margin = margin_bytes(budget, launch.device_type)
    if peak + margin <= budget:
        return peak
    over = f"{_gib(peak)} + {_gib(margin)} margin, {_gib(peak + margin - budget)} over"
    advice = f"find one that fits: effitrain plan --memory {text} (same options)"
    if result.memory.parameter_bytes <= QUICK_PLAN_BYTES:
        try:
            best = plan(config, launch, budget, workers=0).candidates[0]
        except EffitrainError:
            advice = "nothing the plan tries fits it either"
        else:
            advice = f"this fits (peak {_gib(best.peak_tensor_bytes)}): {shlex.join(best.args)}"
    raise EffitrainError(f"--max-memory {text}: the estimated peak per device is {over}; {advice}")


def launch_from_environment() -> Launch:
    """The launch ``accelerate launch`` set up for this process, read from its environment
    before Accelerate is started (processes, FSDP or DeepSpeed's stage, the device type)."""
    import os

    import torch

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    strategy = "ddp"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        strategy = "fsdp"
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        strategy = f"zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    return Launch.described(processes, strategy, device)
