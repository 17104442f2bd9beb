"""``effitrain estimate``: the memory ``effitrain train`` would measure, before training."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from effitrain.cli.errors import user_errors
from effitrain.cli.train import LEVERS, LOOP, MODEL, OPTIM, OUT, _opt, _quiet_libraries
from effitrain.config import default_for as D

FIELDS = (
    ("parameters", "parameter_bytes"),
    ("  trained", "trainable_parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state.bytes"),
    ("activations", "activation_bytes"),
    ("peak tensor memory", "peak_tensor_bytes"),
)
"""Rows of the table: label, the metrics JSON's field (dotted: nested)."""


def field(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None  # type: ignore[assignment]
    return data


def estimate(
    ctx: typer.Context,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config", help="YAML file of `effitrain train` options.", rich_help_panel=OUT
        ),
    ] = None,
    task: Annotated[str | None, _opt("task", MODEL)] = None,
    model: Annotated[str, _opt("model", MODEL)] = D("model"),
    dataset: Annotated[str, _opt("dataset", MODEL, " Read for its number of labels.")] = D(
        "dataset"
    ),
    dataset_config: Annotated[str | None, _opt("dataset_config", MODEL)] = None,
    train_file: Annotated[str | None, _opt("train_file", MODEL)] = None,
    validation_file: Annotated[str | None, _opt("validation_file", MODEL)] = None,
    text_columns: Annotated[str | None, _opt("text_columns", MODEL)] = None,
    label_column: Annotated[str | None, _opt("label_column", MODEL)] = None,
    max_length: Annotated[
        int, _opt("max_length", MODEL, " The estimate assumes every example this long.")
    ] = D("max_length"),
    optim: Annotated[
        str,
        typer.Option(
            "--optim",
            help="Optimizer name, several comma-separated, or 'all' (one row per installed one).",
            rich_help_panel=OPTIM,
            metavar="NAME[,NAME]|all",
        ),
    ] = D("optim"),
    lr: Annotated[float | None, _opt("lr", OPTIM)] = None,
    weight_decay: Annotated[float, _opt("weight_decay", OPTIM)] = D("weight_decay"),
    max_grad_norm: Annotated[float | None, _opt("max_grad_norm", OPTIM)] = None,
    fp32_embedding_state: Annotated[bool, _opt("fp32_embedding_state", OPTIM)] = D(
        "fp32_embedding_state"
    ),
    batch_size: Annotated[int, _opt("batch_size", LOOP)] = D("batch_size"),
    grad_accum: Annotated[int, _opt("grad_accum", LOOP)] = D("grad_accum"),
    mixed_precision: Annotated[str, _opt("mixed_precision", LOOP)] = D("mixed_precision"),
    seed: Annotated[int, _opt("seed", LOOP)] = D("seed"),
    gradient_checkpointing: Annotated[bool, _opt("gradient_checkpointing", LEVERS)] = D(
        "gradient_checkpointing"
    ),
    optimizer_in_backward: Annotated[bool, _opt("optimizer_in_backward", LEVERS)] = D(
        "optimizer_in_backward"
    ),
    weights_dtype: Annotated[str, _opt("weights_dtype", LEVERS)] = D("weights_dtype"),
    lora_rank: Annotated[int | None, _opt("lora_rank", LEVERS)] = None,
    lora_alpha: Annotated[float | None, _opt("lora_alpha", LEVERS)] = None,
    lora_dropout: Annotated[float | None, _opt("lora_dropout", LEVERS)] = None,
    lora_target_modules: Annotated[str | None, _opt("lora_target_modules", LEVERS)] = None,
    num_processes: Annotated[
        int,
        typer.Option(
            "--num-processes",
            min=1,
            rich_help_panel=LOOP,
            help="Also show each process's share when this many processes train together.",
        ),
    ] = 1,  # fmt: skip
    sharding: Annotated[
        str,
        typer.Option(
            "--sharding",
            rich_help_panel=LOOP,
            metavar="ddp|zero1|zero2|zero3|fsdp",
            help="How --num-processes processes split the model: ddp (nothing), zero1 (optimizer "
            "state), zero2 (+ gradients), zero3 or fsdp (+ parameters).",
        ),
    ] = "ddp",  # fmt: skip
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (the metrics JSON's field names).")
    ] = False,
    compare_to: Annotated[
        Path | None,
        typer.Option(
            "--compare-to",
            help="A run's --metrics-json: show the estimate's error against what it measured.",
            metavar="FILE",
        ),
    ] = None,
) -> None:
    """Estimate a run's memory before training: parameters, gradients, optimizer state,
    activations and peak tensor memory, as `effitrain train` measures them.

    The run's own training step on fake tensors (no weights are loaded or allocated), measured by
    the same tracker and ledger as a real run.
    """
    with user_errors():
        results, skipped = _estimates(ctx, config_file, optim, num_processes, sharding)
        measured = _load_metrics(compare_to) if compare_to else None
        if as_json:
            typer.echo(_json(results, measured, compare_to))
            return
        _print(results, measured)
        for line in skipped:
            typer.echo(f"note: {line}")


def _estimates(
    ctx: typer.Context, config_file: Path | None, optim: str, num_processes: int, sharding: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """One estimate per optimizer of ``--optim``, with the other options as given; and the
    reasons for those that ``--optim all`` skipped."""
    from effitrain.build import checked_config
    from effitrain.errors import EffitrainError
    from effitrain.memory.estimate import SHARDED, per_device
    from effitrain.memory.estimate import estimate as run_estimate
    from effitrain.optim import OPTIMIZERS, get_spec

    own = ("config_file", "as_json", "compare_to", "optim", "num_processes", "sharding")
    overrides = {
        name: value for name, value in ctx.params.items() if name not in own and _given(ctx, name)
    }
    fp32 = overrides.pop("fp32_embedding_state", None)  # see _for_optimizer
    from_file = checked_config(config_file, overrides)
    names = _names(optim if _given(ctx, "optim") else from_file.optim, OPTIMIZERS)
    for name in names:
        get_spec(name)
    _quiet_libraries()
    if sharding not in SHARDED:
        per_device({}, num_processes, sharding)  # the one-line error
    results, skipped = [], []
    for name in names:
        config = checked_config(config_file, _for_optimizer(overrides, name, names, fp32))
        try:
            result = run_estimate(config)
        except EffitrainError as exc:
            if not (_given(ctx, "optim") and optim == "all"):
                raise
            skipped.append(str(exc))  # --optim all: the others still get their column
            continue
        if num_processes > 1:
            result["per_device"] = per_device(result, num_processes, sharding)
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


def _json(results: list[dict[str, Any]], measured: dict[str, Any] | None, path: Any) -> str:
    """``--json``: one estimate, a list, or the estimates with their errors against ``path``."""
    import json

    out: Any = results[0] if len(results) == 1 else results
    if measured is not None:
        out = {
            "estimates": results,
            "compared_to": str(path),
            "errors": _errors(_compared(results, measured), measured),
        }
    return json.dumps(out, indent=2)


def _given(ctx: typer.Context, name: str) -> bool:
    return getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")


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


def _errors(result: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """(estimate - measured) / measured, per field."""
    out: dict[str, float | None] = {}
    for _, key in FIELDS:
        estimate, truth = field(result, key), field(measured, key)
        out[key] = (estimate - truth) / truth if estimate is not None and truth else None
    return out


def _print(results: list[dict[str, Any]], measured: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from effitrain.memory.ledger import format_bytes

    console = Console(highlight=False)
    first = results[0]["estimate"]
    if len(results) > 4 and measured is None:
        console.print(_rows_table(results, first))
        _print_notes(console, results)
        return
    table = Table(
        title=_title(first),
        title_justify="left",
    )
    table.add_column("what")
    for result in results:
        levers = f" + {', '.join(result['levers'])}" if result["levers"] else ""
        table.add_column(result["optimizer"] + levers, justify="right")
    compared = _compared(results, measured) if measured is not None else None
    if measured is not None:
        table.add_column("measured", justify="right")
        table.add_column(f"error ({compared['optimizer']})", justify="right")
    for label, key in FIELDS:
        cells = [format_bytes(field(r, key) or 0) for r in results]
        if measured is not None and compared is not None:
            truth = field(measured, key)
            error = _errors(compared, measured)[key]
            cells += [
                format_bytes(truth) if truth is not None else "-",
                f"{error:+.1%}" if error is not None else "-",
            ]
        table.add_row(label, *cells)
    console.print(table)
    _print_notes(console, results)
    if measured is not None and compared is not None:
        for note in _mismatches(compared, measured):
            console.print(f"note: {note}")


def _print_notes(console: Any, results: list[dict[str, Any]]) -> None:
    if "per_device" in results[0]:
        _print_per_device(console, results)
    console.print(
        "Peak tensor memory: the most bytes of live tensors at once in one optimizer step (the "
        "run's memory table); a process holds more (libraries, the CUDA context, allocator "
        "caching). Every example is assumed --max-length tokens long."
    )
    for note in dict.fromkeys(n for r in results for n in r["notes"]):
        console.print(f"note: {note}")


def _compared(results: list[dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
    """The estimate to set beside a measured run: the one with the run's optimizer, else the
    last."""
    same = [r for r in results if r["optimizer"] == measured.get("optimizer")]
    return same[0] if same else results[-1]


def _mismatches(result: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """Where the measured run was not the configuration estimated (so errors are not errors)."""
    config = measured.get("config", {})
    setting = result["estimate"]
    out = []
    if measured.get("optimizer") != result["optimizer"]:
        out.append(
            f"the measured run used --optim {measured.get('optimizer')}, not {result['optimizer']}"
        )
    for key in ("batch_size", "grad_accum", "mixed_precision"):
        if key in config and config[key] != setting[key]:
            out.append(f"the measured run used {key} {config[key]}, the estimate {setting[key]}")
    if sorted(measured.get("levers", [])) != sorted(result["levers"]):
        out.append(
            f"the measured run's levers ({', '.join(measured.get('levers', [])) or 'none'}) differ "
            f"from the estimate's ({', '.join(result['levers']) or 'none'})"
        )
    if config.get("max_length", setting["max_length"]) < setting["max_length"] or (
        config.get("model") not in (None, setting["model"])
    ):
        out.append("the measured run used another model or --max-length")
    out.append(
        "a run pads each batch to its longest example: with texts shorter than --max-length, it "
        "measures less activation memory than this estimate"
    )
    return out


def _print_per_device(console: Any, results: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from effitrain.memory.ledger import format_bytes

    first = results[0]["per_device"]
    table = Table(
        title=f"Per process: {first['num_processes']} processes, {first['sharding']} "
        f"({first['modeled']})",
        title_justify="left",
    )
    table.add_column("what")
    for result in results:
        table.add_column(result["optimizer"], justify="right")
    for label, key in (
        ("parameters", "parameter_bytes"),
        ("gradients", "gradient_bytes"),
        ("optimizer state", "optimizer_state_bytes"),
        ("activations", "activation_bytes"),
        ("peak tensor memory", "peak_tensor_bytes"),
    ):
        table.add_row(label, *(format_bytes(r["per_device"][key] or 0) for r in results))
    console.print(table)
    console.print(
        "Not included: FSDP's all-gathered layer (one layer's full parameters at a time) and "
        "DDP's gradient buckets."
    )


def _title(first: dict[str, Any]) -> str:
    micro = f", {first['grad_accum']} micro-batches" if first["grad_accum"] > 1 else ""
    return f"Estimate: {first['model']}, batch {first['batch_size']} x {first['max_length']} tokens{micro}"


def _rows_table(results: list[dict[str, Any]], first: dict[str, Any]) -> Any:
    """Many optimizers (--optim all): one row each, the parts as columns."""
    from rich.table import Table

    from effitrain.memory.ledger import format_bytes

    table = Table(title=_title(first), title_justify="left")
    table.add_column("optimizer")
    columns = (
        ("params", "parameter_bytes"),
        ("grads", "gradient_bytes"),
        ("state", "optimizer_state.bytes"),
        ("activations", "activation_bytes"),
        ("peak", "peak_tensor_bytes"),
    )
    for label, _ in columns:
        table.add_column(label, justify="right")
    for result in results:
        table.add_row(
            result["optimizer"], *(format_bytes(field(result, k) or 0) for _, k in columns)
        )
    return table
