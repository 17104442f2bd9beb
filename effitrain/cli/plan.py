"""``effitrain plan``: the fastest configuration that fits a memory budget, before training."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from effitrain.cli.error_handling import user_errors
from effitrain.cli.estimate import SHOWN, Device, NumProcesses, Sharding
from effitrain.cli.options import CONFIG_FILE, PRESET_NAMES, config_fields, config_options
from effitrain.cli.quiet import quiet_libraries
from effitrain.config import LOOP, MEMORY_LEVERS, OPTIMIZER, OPTIONS, default_for

Memory = Annotated[
    str,
    typer.Option(
        "--memory",
        help="Memory per device to fit in: 24GiB, or 24GB (10^9 bytes), 512MiB.",
        metavar="SIZE",
        rich_help_panel=LOOP,
        show_default=False,
    ),
]
Optims = Annotated[
    str | None,
    typer.Option(
        "--optim",
        help="Optimizers to try, comma-separated.",
        rich_help_panel=OPTIMIZER,
        metavar="NAME[,NAME]",
        show_default="adamw,adamw-8bit,adafactor",
    ),
]
FullParameter = Annotated[
    bool,
    typer.Option(
        "--full-parameter",
        help="Train every weight: no LoRA or QLoRA adapters.",
        rich_help_panel=MEMORY_LEVERS,
    ),
]
Without = Annotated[
    str | None,
    typer.Option(
        "--without",
        help="Levers to leave out, comma-separated (names as in the metrics JSON's levers: "
        "gradient-checkpointing, load-in-4bit, optimizer-offload ...).",
        rich_help_panel=MEMORY_LEVERS,
        metavar="LEVER[,LEVER]",
        show_default=False,
    ),
]
MaxLength = Annotated[
    str | None,
    typer.Option(
        OPTIONS["max_length"].flag,
        help=OPTIONS["max_length"].help
        + " The plan assumes every example this long. [bold]longest[/]: the longest sequence "
        "that fits --memory with every lever of the search (micro-batch 1; the global batch 1 "
        "unless --batch-size is given); YAML: max_length: longest.",
        rich_help_panel=OPTIONS["max_length"].panel,
        metavar="N|longest",
        show_default=str(default_for("max_length")),
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
LONGEST = "longest"


@config_options(
    exclude=("optim", "max_memory", "max_length"),
    hidden=[name for name in config_fields() if name not in SHOWN],
    extra_help={
        "model": PRESET_NAMES,
        "batch_size": " With --grad-accum, the global batch the plan keeps.",
    },
)
def plan(
    memory: Memory,
    config_file: Annotated[Path | None, CONFIG_FILE] = None,
    max_length: MaxLength = None,
    optim: Optims = None,
    full_parameter: FullParameter = False,
    without: Without = None,
    num_processes: NumProcesses = 1,
    sharding: Sharding = "ddp",
    device: Device = None,
    as_json: AsJson = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Find the fastest configurations that fit a memory budget, on fake tensors.

    Tries optimizers, memory levers and splits of the batch (micro-batch x --grad-accum, the
    global batch kept) with `effitrain estimate`'s fake-tensor step, and prints those that fit
    --memory per device, fastest first by modeled time per step: peak memory, FLOPs per step,
    why each lever is in, and the `effitrain train` command (under `accelerate launch` with its
    flags for several processes). Each printed answer is verified by a full estimate of its
    command; what only the screens passed is listed apart. No weights are loaded.

    With --max-length longest: the longest sequence that fits instead, and its commands.
    """
    with user_errors():
        quiet_libraries()
        from effitrain.build import checked_config
        from effitrain.cli.estimate import described_launch
        from effitrain.config import parse_size
        from effitrain.planning import plan as run_plan

        budget = parse_size(memory, "--memory")
        wants_longest = _length(max_length, config_file, overrides)
        config = checked_config(config_file, overrides)
        if wants_longest:
            overrides.pop("max_length")  # the search's: each command gives its own
        try:
            with _stopped_by_signals():
                result = run_plan(
                    config,
                    described_launch(config, num_processes, sharding, device),
                    budget,
                    given=overrides,
                    config_file=str(config_file) if config_file else None,
                    full_parameter=full_parameter,
                    optimizers=_names(optim),
                    without=_names(without) or [],
                    worker_setup=quiet_libraries,
                    longest=wants_longest,
                )
        except _Stopped as stop:
            name = signal.Signals(stop.signum).name
            typer.echo(
                f"plan stopped by {name} before it finished; no worker process is left", err=True
            )
            raise typer.Exit(128 + stop.signum) from None
        if as_json:
            import json

            typer.echo(json.dumps(result.to_dict(), indent=2))
            return
        from effitrain.report.plan_table import print_plan

        print_plan(result)


class _Stopped(BaseException):
    """SIGINT or SIGTERM during the search (a BaseException: no ``except Exception`` on the
    way takes it for an estimate's failure)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Raise :class:`_Stopped` at SIGINT or SIGTERM: the search holds nothing worth keeping,
    and leaving its block ends its worker processes."""
    from effitrain.plan_workers import held_signal

    def stop(signum: int, frame: FrameType | None) -> None:
        if not held_signal(signum):
            raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _length(value: str | None, config_file: Path | None, overrides: dict[str, Any]) -> bool:
    """Whether the plan searches for the longest length (``--max-length longest``, or the
    YAML's ``max_length: longest`` where the option is not given); else a number given is put
    in ``overrides``. For the search, ``overrides`` get a length that stands in for the YAML's
    word (the config's checks need a number) and batch 1 unless a batch size is given.

    Raises:
        EffitrainError: a value that is neither a number nor ``longest``.
    """
    from effitrain.config import load_yaml
    from effitrain.errors import EffitrainError

    in_file = {
        str(k).replace("-", "_"): v
        for k, v in (load_yaml(config_file) if config_file else {}).items()
    }
    if value is None:
        if in_file.get("max_length") != LONGEST:
            return False
    elif value != LONGEST:
        if not value.isdigit():
            raise EffitrainError(
                f"--max-length {value}: give a number of tokens, or {LONGEST} (the longest "
                "sequence that fits --memory)"
            )
        overrides["max_length"] = int(value)
        return False
    overrides["max_length"] = default_for("max_length")
    grpo = "grpo" in (overrides.get("task"), in_file.get("task"))  # refused by the plan itself
    if "batch_size" not in overrides and "batch_size" not in in_file and not grpo:
        overrides["batch_size"] = 1
    return True


def _names(value: str | None) -> list[str] | None:
    names = [name.strip() for name in (value or "").split(",") if name.strip()]
    return names or None
