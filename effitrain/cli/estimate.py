"""``effitrain estimate``: the memory ``effitrain train`` would measure, before training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from effitrain.cli.error_handling import user_errors
from effitrain.cli.options import CONFIG_FILE, PRESET_NAMES, config_fields, config_options
from effitrain.cli.quiet import quiet_libraries
from effitrain.config import LOOP, OPTIMIZER
from effitrain.distributed import DEVICE_TYPES, STRATEGIES
from effitrain.levers import LEVERS

SHOWN = (
    *("task", "model", "dataset", "dataset_config", "train_file", "validation_file"),
    *("text_columns", "label_column", "max_length"),
    *("lr", "weight_decay", "max_grad_norm", "fp32_embedding_state"),
    *("batch_size", "grad_accum", "mixed_precision", "seed"),
    *(name for lever in LEVERS.values() for name in lever.fields if name not in lever.save_only),
)
"""The train options that change what a step holds (every lever's); the others are accepted and
not listed, so that any `effitrain train` command line can be estimated by changing its
command's name."""

Optims = Annotated[
    str | None,
    typer.Option(
        "--optim",
        help="Optimizer name, several comma-separated, or 'all' (one row per installed one).",
        rich_help_panel=OPTIMIZER,
        metavar="NAME[,NAME]|all",
        show_default="adamw",
    ),
]
NumProcesses = Annotated[
    int,
    typer.Option(
        "--num-processes",
        rich_help_panel=LOOP,
        metavar="N",
        help="Also show each process's share when this many processes train together.",
    ),
]
Sharding = Annotated[
    str,
    typer.Option(
        "--sharding",
        rich_help_panel=LOOP,
        metavar="|".join(STRATEGIES),
        help="How --num-processes processes split the model: ddp (nothing), zero1 (optimizer "
        "state), zero2 (+ gradients), zero3 or fsdp (+ parameters; FSDP2, tensor by tensor).",
    ),
]
Device = Annotated[
    str | None,
    typer.Option(
        "--device",
        rich_help_panel=LOOP,
        metavar="|".join(DEVICE_TYPES),
        help="The device the run will train on (the offload levers need cuda); the estimate "
        "itself runs on fake tensors here.",
        show_default="this machine's",
    ),
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print JSON (the metrics JSON's field names).")
]
CompareTo = Annotated[
    Path | None,
    typer.Option(
        "--compare-to",
        help="A run's --metrics-json: show the estimate's error against what it measured.",
        metavar="FILE",
    ),
]


@config_options(
    exclude=("optim",),
    hidden=[name for name in config_fields() if name not in SHOWN],
    extra_help={
        "model": PRESET_NAMES,
        "dataset": " Read for its number of labels.",
        "max_length": " The estimate assumes every example this long.",
    },
)
def estimate(
    config_file: Annotated[Path | None, CONFIG_FILE] = None,
    optim: Optims = None,
    num_processes: NumProcesses = 1,
    sharding: Sharding = "ddp",
    device: Device = None,
    as_json: AsJson = False,
    compare_to: CompareTo = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Estimate a run's memory before training it, on fake tensors: no weights are loaded.

    Parameters, gradients, optimizer state, activations and peak tensor memory, as `effitrain
    train` measures them: the run's own training step runs on fake tensors (no weights are
    loaded or allocated), measured by the same tracker and ledger as a real run. Takes every
    option of `effitrain train`; those that change nothing a step holds are not listed.
    """
    with user_errors():
        quiet_libraries()
        results, skipped = _estimates(
            config_file,
            overrides,
            optim,
            lambda config: described_launch(config, num_processes, sharding, device),
        )
        measured = _load_metrics(compare_to) if compare_to else None
        against = _against(results, measured, compare_to) if measured is not None else None
        if as_json:
            typer.echo(_json(results, against))
            return
        from effitrain.report.estimate_tables import print_estimates

        print_estimates(results, against, skipped)


def described_launch(config: Any, num_processes: int, sharding: str, device: str | None) -> Any:
    """The launch the options describe. Without --device: the device the levers need (an
    offload lever: cuda, estimated from any machine), else this machine's."""
    from effitrain.distributed import Launch
    from effitrain.levers import device_needed

    if device is None:
        import torch

        device = device_needed(config) or ("cuda" if torch.cuda.is_available() else "cpu")
    return Launch.described(num_processes, sharding, device)


def _estimates(
    config_file: Path | None,
    overrides: dict[str, Any],
    optim: str | None,
    launch_for: Callable[[Any], Any],
) -> tuple[list[Any], list[str]]:
    """One estimate per optimizer of ``--optim``, with the other options as given; and the
    reasons for those that ``--optim all`` skipped."""
    from effitrain.build import checked_config
    from effitrain.errors import EffitrainError
    from effitrain.estimation import estimate as run_estimate
    from effitrain.optim import OPTIMIZERS, get_spec

    fp32 = overrides.pop("fp32_embedding_state", None)  # see _for_optimizer
    from_file = checked_config(config_file, overrides)
    launch = launch_for(from_file)
    names = _names(optim or from_file.optim, OPTIMIZERS)
    for name in names:
        get_spec(name)
    results, skipped = [], []
    for name in names:
        config = checked_config(config_file, _for_optimizer(overrides, name, names, fp32))
        try:
            result = run_estimate(config, launch)
        except EffitrainError as exc:
            if optim != "all":
                raise
            skipped.append(str(exc))  # --optim all: the others still get their column
            continue
        results.append(result)
    return results, skipped


def _for_optimizer(
    overrides: dict[str, Any], name: str, names: list[str], fp32: bool | None
) -> dict[str, Any]:
    """The options of ``name``'s column: ``--fp32-embedding-state`` goes to the bitsandbytes
    optimizers among several (alone, any optimizer gets it, and refuses it if it must)."""
    from effitrain.optim import get_spec

    only: dict[str, Any] = {"optim": name}
    if fp32 is not None and (len(names) == 1 or get_spec(name).takes_fp32_embedding_state):
        only["fp32_embedding_state"] = fp32
    return {**overrides, **only}


def _names(value: str, registry: dict[str, Any]) -> list[str]:
    if value == "all":
        return [name for name, spec in registry.items() if spec.is_available()]
    return [name.strip() for name in value.split(",") if name.strip()]


def _load_metrics(path: Path) -> dict[str, Any]:
    import json

    from effitrain.errors import EffitrainError

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EffitrainError(f"--compare-to {path}: cannot read a metrics JSON ({exc})") from None


def _against(results: list[Any], measured: dict[str, Any], path: Path) -> dict[str, Any]:
    """The estimate set beside a measured run (the one with the run's optimizer, else the
    last), its relative errors per field, and where the run was another configuration."""
    same = [r for r in results if r.optimizer == measured.get("optimizer")]
    compared = same[0] if same else results[-1]
    return {
        "path": str(path),
        "measured": measured,
        "optimizer": compared.optimizer,
        "errors": _errors(compared.to_dict(), measured),
        "mismatches": _mismatches(compared, measured),
    }


def _errors(result: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """(estimate - measured) / measured, per field of the two metrics JSONs."""
    from effitrain.report.estimate_tables import estimate_fields, metrics_field

    out: dict[str, float | None] = {}
    for _, key in estimate_fields(result):
        estimate, truth = metrics_field(result, key), metrics_field(measured, key)
        out[key] = (estimate - truth) / truth if estimate is not None and truth else None
    return out


def _mismatches(result: Any, measured: dict[str, Any]) -> list[str]:
    """Where the measured run was not the configuration estimated (so errors are not errors)."""
    config = measured.get("config", {})
    setting = result.settings
    out = []
    if measured.get("optimizer") != result.optimizer:
        out.append(
            f"the measured run used --optim {measured.get('optimizer')}, not {result.optimizer}"
        )
    for key in ("batch_size", "grad_accum", "mixed_precision"):
        if key in config and config[key] != getattr(setting, key):
            out.append(
                f"the measured run used {key} {config[key]}, the estimate {getattr(setting, key)}"
            )
    levers = result.memory.levers
    if sorted(measured.get("levers", [])) != sorted(levers):
        out.append(
            f"the measured run's levers ({', '.join(measured.get('levers', [])) or 'none'}) differ "
            f"from the estimate's ({', '.join(levers) or 'none'})"
        )
    if config.get("max_length", setting.max_length) < setting.max_length or (
        config.get("model") not in (None, setting.model)
    ):
        out.append("the measured run used another model or --max-length")
    out.append(
        "a run pads each batch to its longest example: with texts shorter than --max-length, it "
        "measures less activation memory than this estimate"
    )
    return out


def _json(results: list[Any], against: dict[str, Any] | None) -> str:
    """``--json``: one estimate, a list, or the estimates with their errors against a run."""
    import json

    dicts = [r.to_dict() for r in results]
    out: Any = dicts[0] if len(dicts) == 1 else dicts
    if against is not None:
        out = {"estimates": dicts, "compared_to": against["path"], "errors": against["errors"]}
    return json.dumps(out, indent=2)
