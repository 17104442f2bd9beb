"""``effitrain estimate`` against real ``effitrain train`` runs of the same configuration:
parameters, gradients and optimizer state equal to the byte; activations and peak tensor memory
within 10 % (the issue's target), on data long enough that every batch is full length."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from effitrain.errors import EffitrainError
from tests.conftest import assert_clean_error

EXACT = ("parameter_bytes", "trainable_parameter_bytes", "gradient_bytes")
WITHIN = ("activation_bytes", "peak_tensor_bytes")
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> list[str]:
    """Texts of 200 words, so every example fills --max-length tokens, as the estimate assumes."""
    folder = tmp_path_factory.mktemp("long")
    rng = random.Random(0)
    words = [
        "the",
        "committee",
        "approved",
        "budget",
        "report",
        "was",
        "board",
        "rejected",
        "plan",
        "a",
        "new",
    ]
    for name, rows in (("train", 48), ("validation", 8)):
        lines = ["text,label"] + [
            f"{' '.join(rng.choices(words, k=200))},{rng.randint(0, 1)}" for _ in range(rows)
        ]
        (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return [
        "--train-file",
        str(folder / "train.csv"),
        "--validation-file",
        str(folder / "validation.csv"),
    ]


@pytest.fixture(scope="module")
def estimated_once() -> dict:
    """The module's estimates by their configuration and launch (see ``cached_estimates``)."""
    return {}


@pytest.fixture
def cached_estimates(estimated_once, monkeypatch):
    """``effitrain.estimation.estimate`` (which the CLI calls) computes each configuration once
    in this module: the tests that estimate what another test's run was compared with (``--optim
    all``, several optimizers' columns) take that estimate (a copy) instead of a second one."""
    import copy

    from effitrain import estimation
    from effitrain.distributed import Launch

    compute = estimation.estimate

    def cached(config, launch=None):
        launch = launch or Launch.described(1, "ddp", "cpu")
        key = (repr(config), launch)
        if key not in estimated_once:
            estimated_once[key] = compute(config, launch)
        return copy.deepcopy(estimated_once[key])

    monkeypatch.setattr(estimation, "estimate", cached)


def compare(train_cli, tmp_path: Path, args: list[str], flops: bool = True) -> tuple[dict, dict]:
    """``flops``: the step's FLOPs are equal too (not where the run's packed blocks hold other
    documents than the estimate's two: attention's FLOPs are per document)."""
    from effitrain import estimation
    from effitrain.cli.compare import train_config

    estimate = estimation.estimate  # where a test takes ``cached_estimates``, the cached one

    metrics = tmp_path / "metrics.json"
    with flop_counter_mode_beside() as reference:
        proc = train_cli(
            "train", "--quiet", "--max-steps", "2", *args, "--metrics-json", str(metrics)
        )
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(metrics.read_text())
    estimated = estimate(train_config(args)).to_dict()
    # FLOPs of the fake step equal the real step's, and PyTorch's FlopCounterMode's on it.
    assert measured["flops_per_step"] == reference.pop() > 0
    if flops:
        assert estimated["flops_per_step"] == measured["flops_per_step"]
        assert estimated["recompute_flops"] == measured["recompute_flops"]
    for key in EXACT:
        assert estimated[key] == measured[key], (key, estimated[key], measured[key])
    assert estimated["optimizer_state"] == measured["optimizer_state"]
    assert estimated["trainable_parameters"] == measured["trainable_parameters"]
    assert estimated["baseline"] == measured["baseline"]
    for key in WITHIN:
        error = abs(estimated[key] - measured[key]) / measured[key]
        assert error <= TOLERANCE, (key, estimated[key], measured[key], f"{error:.1%}")
    return estimated, measured


@contextmanager
def flop_counter_mode_beside() -> Iterator[list[int]]:
    """PyTorch's own ``FlopCounterMode`` counts the step effitrain counts (the first), beside
    it: its total is appended to the list yielded."""
    from torch.utils.flop_counter import FlopCounterMode

    import effitrain.loop
    from effitrain.cost import StepCounter, extra_flop_formulas

    totals: list[int] = []

    class WithReference(StepCounter):
        def __enter__(self):
            super().__enter__()
            self.reference = FlopCounterMode(
                display=False, custom_mapping=extra_flop_formulas()
            ).__enter__()
            return self

        def __exit__(self, *exc):
            self.reference.__exit__(*exc)
            totals.append(self.reference.get_total_flops())
            super().__exit__(*exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(effitrain.loop, "StepCounter", WithReference)
        yield totals


EACH_OPTIMIZER_SHAPE = ("--batch-size", "8", "--max-length", "48")
"""The batch of the plain run's and the per-optimizer comparisons, and of the CLI tests that
estimate several optimizers: their estimates are the comparisons' (``cached_estimates``)."""


def test_estimate_equals_a_run(train_cli, tmp_path, long_data, cached_estimates):
    compare(train_cli, tmp_path, [*long_data, *EACH_OPTIMIZER_SHAPE])


@pytest.mark.parametrize(
    "options",
    [
        [],
        pytest.param(["--gradient-checkpointing", "--optim", "adamw-8bit"], marks=pytest.mark.slow),
    ],
)
def test_estimate_equals_a_packed_causal_lm_run(train_cli, tmp_path, options):
    """A packed block of the demo holds several documents, kept apart by a block-diagonal mask
    at this length; the estimate's block, made by the run's own collator, holds two, and counts
    that mask too (an all-ones attention mask once let the model skip it: 76 KB under the run
    at 4 x 128 tokens, so a plan's answer could fail its own --max-memory). Longer blocks are
    attended per document: tests/test_long_context.py."""
    args = ["--task", "causal-lm", "--model", "tiny-llama", "--batch-size", "4",
            "--max-length", "128", *options]  # fmt: skip
    estimated, measured = compare(train_cli, tmp_path, args)
    assert estimated["peak_tensor_bytes"] == measured["peak_tensor_bytes"]
    assert estimated["activation_bytes"] == measured["activation_bytes"]


@pytest.mark.slow
def test_estimate_equals_a_run_of_two_document_blocks(train_cli, tmp_path, long_lm_model_dir):
    """Blocks of two 1,024-token documents, as the estimate's, attended per document: its FLOPs
    are the run's too (attention's are per document)."""
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(long_lm_model_dir)
    words = next(n for n in range(1023, 0, -1) if len(tokens(" ".join(["a"] * n)).input_ids) < 1024)
    assert len(tokens(" ".join(["a"] * words)).input_ids) == 1023  # and the eos: 1,024
    path = tmp_path / "a.txt"
    path.write_text("\n\n".join([" ".join(["a"] * words)] * 12))  # no newline: no token
    args = ["--task", "causal-lm", "--model", str(long_lm_model_dir), "--train-file", str(path),
            "--batch-size", "1", "--max-length", "2048"]  # fmt: skip
    estimated, measured = compare(train_cli, tmp_path, args)
    assert estimated["peak_tensor_bytes"] == measured["peak_tensor_bytes"]


@pytest.mark.slow
def test_estimate_equals_a_run_of_one_two_step_epoch(train_cli, tmp_path, long_data):
    """48 rows at batch 24: the run's last step ends the epoch, and the step before it is the
    first, whose backward runs before AdamW has created its state; the breakdown must measure
    the second step (a steady one), not the first."""
    compare(train_cli, tmp_path, [*long_data, "--batch-size", "24", "--max-length", "64"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "options,row_block_elements",
    [
        (["--optim", "adafactor", "--weights-dtype", "bf16"], 16384),
        (["--optim", "adafactor-hf", "--weights-dtype", "bf16", "--optimizer-in-backward"], None),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else f"blocks of {value or 2**27}",
)
def test_estimate_of_stochastic_rounding(
    train_cli, tmp_path, long_data, monkeypatch, options, row_block_elements
):
    """bf16 Adafactor: the fp32 factors and the rounding generators' states (real tensors, made
    under the fake mode) to the byte; the random draw itself runs on fake tensors. With blocks
    of 16384 elements (the embedding and the feed-forward matrices in 2 blocks of rows, the
    embedding's second shorter; the attention matrices whole), the estimate runs the run's row
    blocks: the state is equal to the byte and the peak within 10 % there too."""
    from effitrain.optim import stochastic_rounding

    if row_block_elements is not None:
        monkeypatch.setattr(stochastic_rounding, "ROW_BLOCK_ELEMENTS", row_block_elements)
    estimated, _ = compare(
        train_cli, tmp_path, [*long_data, "--batch-size", "4", "--max-length", "32", *options]
    )
    assert "rounding_generator" in estimated["optimizer_state"]["by_key"]


@pytest.mark.slow
@pytest.mark.parametrize("batch,length", [(16, 48), (2, 64)])
def test_estimate_at_batch_and_length(train_cli, tmp_path, long_data, batch, length):
    """Beside the plain run's 8 x 48 (and the stochastic rounding's 4 x 32): a larger batch,
    and a longer, narrower one."""
    estimated, _ = compare(
        train_cli, tmp_path, [*long_data, "--batch-size", str(batch), "--max-length", str(length)]
    )
    assert estimated["estimate"]["max_length"] == length


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        ["--optim", "adafactor"],
        ["--optim", "adafactor-hf"],
        ["--optim", "adamw-8bit"],
        ["--optim", "sgd"],
        *(
            ["--optim", name]
            for name in (
                "adam-mini",
                "muon",
                "galore",
                "apollo",
                "apollo-mini",
                "lion",
                "lion-8bit",
                "came",
                "adamw-schedule-free",
            )
        ),
        ["--optimizer-in-backward"],
        ["--weights-dtype", "bf16"],
        ["--lora-rank", "4"],
        ["--grad-accum", "2"],
        ["--mixed-precision", "bf16"],
        [
            "--optim",
            "adafactor-hf",
            "--gradient-checkpointing",
            "--optimizer-in-backward",
            "--weights-dtype",
            "bf16",
            "--lora-rank",
            "4",
        ],
    ],  # fmt: skip
    ids=lambda options: " ".join(options),
)
def test_estimate_per_optimizer_and_lever(
    train_cli, tmp_path, long_data, cached_estimates, options
):
    """Each optimizer, and the levers alone and together. Gradient checkpointing is compared
    with the others (the last case) and on a causal LM (the packed run's second case)."""
    compare(train_cli, tmp_path, [*long_data, *EACH_OPTIMIZER_SHAPE, *options])


@pytest.mark.slow
def test_estimate_of_a_pretrained_folder_reads_no_weights(
    train_cli, tmp_path, long_data, tiny_model_dir
):
    (tmp_path / "copy").mkdir()
    for item in tiny_model_dir.iterdir():
        if item.suffix != ".safetensors":  # the estimate needs the config and tokenizer only
            (tmp_path / "copy" / item.name).write_bytes(item.read_bytes())
    from effitrain.cli.compare import train_config
    from effitrain.estimation import estimate

    args = [*long_data, "--batch-size", "8", "--max-length", "32"]
    without_weights = estimate(train_config([*args, "--model", str(tmp_path / "copy")])).to_dict()
    estimated, _ = compare(train_cli, tmp_path, [*args, "--model", str(tiny_model_dir)])
    assert without_weights["peak_tensor_bytes"] == estimated["peak_tensor_bytes"]


@pytest.mark.slow
def test_cli_json_uses_the_metrics_field_names(train_cli, long_data, cached_estimates):
    args = (*long_data, *EACH_OPTIMIZER_SHAPE)
    proc = train_cli("estimate", *args, "--optim", "adamw,sgd", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["optimizer"] for r in rows] == ["adamw", "sgd"]
    for key in ("parameter_bytes", "gradient_bytes", "activation_bytes", "peak_tensor_bytes"):
        assert rows[0][key] > 0
    # A preset reads no checkpoint; on the CPU the step's tensors are the host's.
    host = rows[0]["host_memory"]
    assert host["checkpoint"] is None and host["peak_at"] == "the training step"
    assert rows[0]["host_peak_bytes"] == host["library_bytes"] + rows[0]["peak_tensor_bytes"]
    # AdamW: two moments and a step per tensor; SGD: one momentum buffer.
    tensors = rows[0]["optimizer_state"]["by_key"]["step"]["tensors"]
    assert (
        rows[0]["optimizer_state"]["bytes"] == 2 * rows[1]["optimizer_state"]["bytes"] + 4 * tensors
    )


@pytest.mark.slow
def test_cli_all_optimizers_and_compare_to(train_cli, tmp_path, long_data, cached_estimates):
    from effitrain.optim import OPTIMIZERS

    metrics = tmp_path / "m.json"
    args = [*long_data, *EACH_OPTIMIZER_SHAPE]
    assert train_cli("train", "--quiet", "--max-steps", "2", *args, "--optim", "sgd",
                     "--metrics-json", str(metrics)).returncode == 0  # fmt: skip
    proc = train_cli("estimate", *args, "--optim", "all")
    assert proc.returncode == 0, proc.stderr
    installed = [name for name, spec in OPTIMIZERS.items() if spec.is_available()]
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│")]
    for name in installed:  # a row each, or a note why not (torchao: compiled step)
        assert name in rows or f"cannot estimate --optim {name}" in proc.stdout, name
    assert len(rows) >= len(installed) - 3
    proc = train_cli("estimate", *args, "--optim", "adamw,sgd", "--compare-to", str(metrics))
    header = next(line for line in proc.stdout.splitlines() if "what" in line)
    assert "adamw" in header and "error (sgd)" in header
    parameters = next(line for line in proc.stdout.splitlines() if "parameters" in line)
    assert "+0.0%" in parameters
    flops = next(line for line in proc.stdout.splitlines() if "FLOPs per step" in line)
    counts = re.findall(r"[\d.]+ [MG]FLOP", flops)  # adamw's, sgd's, the run's: the same
    assert len(counts) == 3 and len(set(counts)) == 1, flops
    proc = train_cli("estimate", *args, "--compare-to", str(metrics), "--json")
    errors = json.loads(proc.stdout)["errors"]
    assert errors["parameter_bytes"] == 0 and errors["optimizer_state.bytes"] > 0  # adamw vs sgd


@pytest.mark.slow
def test_estimate_runs_the_loops_own_step(monkeypatch):
    """The estimate is the loop's own training step on fake tensors, not a model of it: every
    micro-batch of its steps goes through effitrain.loop.train_step."""
    import effitrain.estimation
    import effitrain.loop
    from effitrain.build import checked_config
    from effitrain.estimation import estimate

    calls = []
    train_step = effitrain.loop.train_step

    def counted(run, batch, *args, **kwargs):
        calls.append(run.config.grad_accum)
        return train_step(run, batch, *args, **kwargs)

    monkeypatch.setattr(effitrain.loop, "train_step", counted)
    config = checked_config(None, {"grad_accum": 3, "max_length": 16, "batch_size": 2})
    result = estimate(config)
    assert effitrain.estimation.STEPS == 2
    assert calls == [3] * (3 * 2)  # grad_accum micro-batches in each of the 2 steps
    assert result.settings.measured_step == 2 and result.settings.grad_accum == 3
    assert result.memory.step_memory is not None  # the last step was measured


@pytest.mark.slow
def test_offload_levers_are_estimated_for_the_gpu_they_need(train_cli, monkeypatch):
    """--activation-offload moves activations off a GPU: train refuses it on a CPU, and so does
    an estimate told that the run is on a CPU (--device cpu). Estimating it from a CPU-only
    machine is the point: without --device the estimate is for the device the lever needs, on
    fake tensors here, and says so."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, anywhere
    args = ("--activation-offload", "--max-length", "16", "--batch-size", "2")
    line = assert_clean_error(
        train_cli("estimate", *args, "--device", "cpu"), "--activation-offload"
    )
    assert "this run's device is the CPU" in line
    for device in ([],):  # --device cuda: the same launch, given (test_offload.py estimates it)
        proc = train_cli("estimate", *args, *device, "--json")
        assert proc.returncode == 0, proc.stderr
        row = json.loads(proc.stdout)
        assert row["levers"] == ["activation-offload"]
        assert row["activation_offload_host_bytes"] > 0
        assert row["activation_bytes"] > 0 and row["peak_tensor_bytes"] > 0
        assert any("estimated for cuda" in note for note in row["notes"]), row["notes"]
    plain = json.loads(train_cli("estimate", *args[1:], "--json").stdout)
    assert not any("estimated for" in note for note in plain["notes"])  # this machine: the CPU


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["--lora-rank", "8", "--num-processes", "2", "--sharding", "zero3"],
            "--lora-rank is not supported under DeepSpeed ZeRO-3 over 2 processes",
        ),
        (
            ["--weights-dtype", "bf16", "--num-processes", "2", "--sharding", "fsdp"],
            "--weights-dtype bf16 is not supported under FSDP2 full shard over 2 processes",
        ),
        (
            ["--optimizer-offload", "state", "--num-processes", "2"],
            "--optimizer-offload cannot run on DDP over 2 processes",
        ),
        (["--optimizer-offload", "state", "--device", "cpu"], "this run's device is the CPU"),
    ],
    ids=["lora-zero3", "bf16-fsdp", "offload-ddp", "offload-cpu"],
)
def test_estimate_refuses_the_launches_train_refuses(train_cli, args, fragment):
    """One list of launch checks (each lever's ``check_launch``) for train and estimate: the
    launch estimate is told about is refused as train refuses it, in the same words."""
    from effitrain.build import check_launch, checked_config
    from effitrain.distributed import Launch
    from effitrain.errors import EffitrainError

    line = assert_clean_error(train_cli("estimate", "--max-length", "16", *args), fragment)
    # The same words as train's check on the launch Accelerate would report.
    options = dict(zip(args[::2], args[1::2], strict=True))
    n = int(options.pop("--num-processes", 1))
    sharding, device = options.pop("--sharding", "ddp"), options.pop("--device", "cuda")
    overrides = {flag[2:].replace("-", "_"): value for flag, value in options.items()}
    overrides["lora_rank"] = int(overrides["lora_rank"]) if "lora_rank" in overrides else None
    config = checked_config(None, {k: v for k, v in overrides.items() if v is not None})
    with pytest.raises(EffitrainError) as error:
        check_launch(config, Launch.described(n, sharding, device))
    assert line == f"error: {error.value}"


def test_launches_train_refuses_are_refused(train_cli):
    """The launch checks of train apply to estimate: the optimizer's update in backward runs
    before DDP averages the gradients, so two processes are refused in one line."""
    args = ("--max-length", "16", "--batch-size", "2")
    assert train_cli("estimate", *args, "--optimizer-in-backward", "--json").returncode == 0
    assert_clean_error(
        train_cli("estimate", *args, "--optimizer-in-backward", "--num-processes", "2"),
        "--optimizer-in-backward cannot run on DDP over 2 processes",
    )


def test_cli_errors_are_one_line(train_cli, tmp_path):
    assert_clean_error(train_cli("estimate", "--optim", "nope"), "unknown optimizer 'nope'")
    assert_clean_error(train_cli("estimate", "--mixed-precision", "fp16"), "fp16")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert_clean_error(train_cli("estimate", "--compare-to", str(bad)), "--compare-to")
    assert_clean_error(train_cli("estimate", "--num-processes", "0"), "--num-processes")


def test_takes_a_train_command_line(train_cli):
    """Any `effitrain train` command line estimates when `train` becomes `estimate`: the options
    that change nothing a step holds are accepted (not listed), and checked as train checks them."""
    args = ("--max-length", "16", "--batch-size", "2", "--epochs", "3", "--log-every", "5")
    proc = train_cli("estimate", *args, "--scheduler", "cosine", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["estimate"]["batch_size"] == 2
    assert_clean_error(train_cli("estimate", "--save-every", "5"), "add --output-dir")
    assert "--log-every" not in train_cli("estimate", "--help").stdout


def test_tracker_warnings_are_silenced_only_in_the_step():
    import warnings

    from effitrain.memory.step import TRACKER_WARNINGS, _quiet_tracker_warnings

    formatwarning = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore = _quiet_tracker_warnings()
        warnings.formatwarning = lambda *a, **k: "replaced"  # as ModTracker does
        for message in TRACKER_WARNINGS:
            warnings.warn(message + " and more", UserWarning, stacklevel=1)
        warnings.warn("effitrain's own", UserWarning, stacklevel=1)
        restore()
        warnings.warn(TRACKER_WARNINGS[0], UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["effitrain's own", TRACKER_WARNINGS[0]]
    assert warnings.formatwarning is formatwarning


@pytest.mark.slow  # the end-to-end twin of the test above
def test_gradient_checkpointing_estimate_prints_no_tracker_warning(train_cli, recwarn):
    """A causal LM under gradient checkpointing made ModTracker warn that its module hierarchy
    'maybe be messed up' (twice): the estimate's output is its own."""
    proc = train_cli("estimate", "--task", "causal-lm", "--gradient-checkpointing",
                     "--max-length", "16", "--batch-size", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert not [w for w in recwarn if "hierarchy" in str(w.message)]


def _memory(
    parameters: int,
    gradients: int,
    state: int,
    *,
    trainable_parameters: int = 0,
    at_peak: dict[str, int] | None = None,
    activations: int | None = None,
    peak: int | None = None,
):
    """A MemoryRecord with these parts (and a measured step where ``at_peak`` or ``activations``
    is given)."""
    from effitrain.memory.ledger import OptimizerStateLedger
    from effitrain.memory.step import StepMemory
    from effitrain.results import Baseline, MemoryRecord

    step = None
    if at_peak is not None or activations is not None:
        at_peak = at_peak or {}
        kind_peaks = {} if activations is None else {"activations": activations}
        step = StepMemory(
            peak_tensor_bytes=sum(at_peak.values()) if peak is None else peak,
            at_peak=at_peak,
            kind_peaks=kind_peaks,
        )
    return MemoryRecord(
        optimizer_state=OptimizerStateLedger(bytes=state),
        parameter_bytes=parameters,
        trainable_parameters=trainable_parameters,
        trainable_parameter_bytes=parameters,
        gradient_bytes=gradients,
        adamw_equivalent_bytes=0,
        adamw_equivalent_elements=0,
        baseline=Baseline(parameters, gradients, 2 * parameters),
        step_memory=step,
    )


def _result(optimizer: str, state: int):
    from effitrain.results import Estimate, EstimateSettings

    settings = EstimateSettings(
        model="tiny",
        batch_size=4,
        max_length=32,
        grad_accum=1,
        mixed_precision="no",
        measured_step=2,
    )
    memory = _memory(1000, 1000, state, activations=500, peak=4000)
    return Estimate(optimizer, "x.Optimizer", 1e-3, memory, settings)


def test_report_renders_columns_rows_and_errors():
    from rich.console import Console

    from effitrain.cli.estimate import _against
    from effitrain.report.estimate_tables import print_estimates

    def shown(*args) -> str:
        console = Console(width=200, record=True)
        print_estimates(*args, console=console)
        return console.export_text()

    two = shown([_result("adamw", 2000), _result("sgd", 1000)])
    header = next(line for line in two.splitlines() if "what" in line)
    assert [cell.strip() for cell in header.split("┃")[2:4]] == ["adamw", "sgd"]
    assert "Estimate: tiny, batch 4 x 32 tokens" in two
    many = shown([_result(f"opt{i}", 1000 * i) for i in range(5)], None, ["adamw-fp8: skipped"])
    rows = [line.split()[1] for line in many.splitlines() if line.startswith("│")]
    assert rows == [f"opt{i}" for i in range(5)]  # one row each
    assert "note: adamw-fp8: skipped" in many
    measured = {**_result("sgd", 1250).to_dict(), "config": {"batch_size": 8}}  # a metrics JSON
    against = _against([_result("adamw", 2000), _result("sgd", 1000)], measured, "m.json")
    assert against["errors"]["optimizer_state.bytes"] == -0.2
    table = shown([_result("adamw", 2000), _result("sgd", 1000)], against)
    state = next(line for line in table.splitlines() if "optimizer state" in line)
    assert [cell.strip() for cell in state.split("│")[3:6]] == ["1000 B", "1.2 KiB", "-20.0%"]
    assert "note: the measured run used batch_size 8, the estimate 4" in table
    from effitrain.memory import host
    from effitrain.memory.ledger import format_bytes
    from effitrain.models import LoadOptions

    weights = host.LandedWeights(elements=250, unquantized_bytes=1000)
    with_host = _result("adamw", 2000)
    with_host.host = host.host_memory(None, weights, LoadOptions(), 1, "cpu", 4000)
    text = shown([with_host])
    assert f"host RAM, one machine │ {format_bytes(host.LIBRARY_BYTES + 4000)}" in text
    assert "the preset built in float32; loading 1000 B (weights made 1000 B)" in text


def test_per_device_splits_what_each_strategy_shards():
    from effitrain.distributed import Launch
    from effitrain.estimation import per_device

    at_peak = {"parameters": 400, "gradients": 400, "optimizer_state": 801, "activations": 10}
    result = _memory(400, 400, 801, at_peak=at_peak, activations=1000)
    ddp = per_device(result, "adamw", 4, "ddp")
    assert (ddp.parameter_bytes, ddp.gradient_bytes, ddp.optimizer_state_bytes) == (400, 400, 801)
    assert ddp.peak_tensor_bytes == 1611
    zero2 = per_device(result, "adamw", 4, "zero2")
    assert (zero2.parameter_bytes, zero2.gradient_bytes, zero2.optimizer_state_bytes) == (
        400,
        100,
        201,
    )
    assert zero2.peak_tensor_bytes == 400 + 100 + 201 + 10
    fsdp = per_device(result, "adamw", 4, "fsdp")
    assert fsdp.parameter_bytes == 100 and fsdp.activation_bytes == 1000
    # An unknown strategy is refused where the launch is described, before any estimate.
    with pytest.raises(EffitrainError, match="unknown --sharding 'zero9'"):
        Launch.described(2, "zero9", "cpu")


def test_fsdp2_per_device_splits_rows_and_keeps_column_factors_whole():
    """Adafactor on a 3 x 5 weight and a 3-vector bias over two processes: rank 0 holds 2 of 3
    rows of the weight, the row factor, the bias and its second moment; the whole 1 x 5 column
    factor; and each step count (a 0-d tensor)."""
    import torch

    from effitrain.estimation import fsdp2_layout, per_device

    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.Adafactor(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    layout = fsdp2_layout(model, optimizer)
    assert layout["optimizer_state"] == {"rows:3": 12 + 12, "whole": 20 + 4 + 4}
    at_peak = {"parameters": 72, "optimizer_state": 52, "activations": 5}
    result = _memory(72, 72, 52, at_peak=at_peak, activations=0)
    share = per_device(result, "adafactor", 2, "fsdp", layout)
    assert share.optimizer_state_bytes == 8 + 8 + 20 + 8
    assert share.parameter_bytes == share.gradient_bytes == (60 + 12) * 2 // 3
    assert share.peak_tensor_bytes == 48 + 44 + 5
    # without the layout, an optimizer that does not factor: the sharded parts plainly halved
    assert per_device(result, "adamw", 2, "zero3").optimizer_state_bytes == 26  # plain halves


@pytest.mark.parametrize(
    ("optim", "per_rank"), [("adafactor", 1000), ("came", 2000), ("adamw", 25)]
)
def test_zero_partitions_unfactor_the_factored_optimizers(optim, per_rank):
    """On ZeRO's flat partitions Adafactor keeps 4 bytes per parameter (CAME 8), split over the
    ranks; AdamW's state is simply split."""
    from effitrain.estimation import per_device

    result = _memory(4000, 4000, 100, trainable_parameters=1000)
    share = per_device(result, optim, 4, "zero2")
    assert share.optimizer_state_bytes == per_rank
    assert ("unfactored" in share.modeled) == (optim != "adamw")
    assert per_device(result, optim, 4, "ddp").optimizer_state_bytes == 100


def test_cli_per_device(train_cli):
    proc = train_cli("estimate", "--max-length", "16", "--batch-size", "2", "--num-processes", "2",
               "--sharding", "fsdp", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    # FSDP2 splits each tensor's rows; rank 0 gets the larger half where they are odd.
    assert -(-row["parameter_bytes"] // 2) <= row["per_device"]["parameter_bytes"]
    assert row["per_device"]["parameter_bytes"] < 0.51 * row["parameter_bytes"]
    assert "FSDP2" in row["per_device"]["modeled"]
    assert_clean_error(
        train_cli("estimate", "--num-processes", "2", "--sharding", "zero9"), "zero9"
    )


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw-8bit-ao", "adamw-4bit"])
def test_torchao_state_from_its_own_allocation(
    train_cli, tmp_path, long_data, cached_estimates, uncompiled, optim
):
    """torchao's compiled update cannot run on fake tensors: the estimate runs its step without
    it (its own state allocation). The state still equals a real run's to the byte (a real run
    does not measure torchao's step by kind, so there is no peak to compare). The run's update
    runs eagerly (``uncompiled``): it writes into the state torchao allocated, in place, the
    compiled one too (test_optim_ao.py checks the state after steps traced as compiled)."""
    from effitrain import estimation
    from effitrain.cli.compare import train_config

    args = [*long_data, *EACH_OPTIMIZER_SHAPE, "--optim", optim]
    metrics = tmp_path / "metrics.json"
    proc = train_cli("train", "--quiet", "--max-steps", "2", *args, "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(metrics.read_text())
    estimated = estimation.estimate(train_config(args)).to_dict()  # --optim all's, if it ran
    assert estimated["optimizer_state"] == measured["optimizer_state"]
    for key in EXACT:
        assert estimated[key] == measured[key], key
    assert any("torchao's own state allocation" in note for note in estimated["notes"])


@pytest.mark.parametrize(
    "optim", ["adamw-8bit-ao", pytest.param("adamw-4bit", marks=pytest.mark.slow)]
)
def test_torchao_estimate_leaves_its_quantization_maps_real(optim):
    """torchao caches its quantization maps for the process on first use: built under the
    estimate's fake tensors they would be placeholders, and a later real run in the same
    process (the Python API, a notebook) would quantize with them."""
    pytest.importorskip("torchao")
    from torchao.optim import quant_utils, subclass_4bit, subclass_8bit

    from effitrain.build import checked_config
    from effitrain.estimation import estimate

    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed.cache_clear()
        module.get_qmap_unsigned.cache_clear()
    estimate(checked_config(None, {"optim": optim, "max_length": 16, "batch_size": 2}))
    assert subclass_8bit.get_qmap_signed() == tuple(quant_utils.create_dynamic_map(signed=True))
    assert subclass_4bit.get_qmap_signed() == tuple(quant_utils.create_dynamic_map(True, 3, 4))
    assert len(set(subclass_8bit.get_qmap_unsigned())) == 256
