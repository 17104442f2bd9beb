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
from effitrain.config import LOOP, MEMORY_LEVERS, OPTIMIZER

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
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]


@config_options(
    exclude=("optim", "max_memory"),
    hidden=[name for name in config_fields() if name not in SHOWN],
    extra_help={
        "model": PRESET_NAMES,
        "batch_size": " With --grad-accum, the global batch the plan keeps.",
        "max_length": " The plan assumes every example this long.",
    },
)
def plan(
    memory: Memory,
    config_file: Annotated[Path | None, CONFIG_FILE] = None,
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
    """
    with user_errors():
        quiet_libraries()
        from effitrain.build import checked_config
        from effitrain.cli.estimate import described_launch
        from effitrain.config import parse_size
        from effitrain.planning import plan as run_plan

        budget = parse_size(memory, "--memory")
        config = checked_config(config_file, overrides)
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


def _names(value: str | None) -> list[str] | None:
    names = [name.strip() for name in (value or "").split(",") if name.strip()]
    return names or None
