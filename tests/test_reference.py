"""DPO's reference model as a memory lever (``--reference adapters|precompute|copy``): the same
reference paid for two ways gives the same losses and weights, a resume reads the precomputed
table back (no second pass, bit-identical weights), LoRA's adapters-off reference adds 0 bytes,
a copy is in the step's peak, ``estimate`` predicts each one, and the refusals are one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.checkpoint_helpers import assert_identical, load_tensors
from tests.conftest import assert_clean_error

SHORT = ("--max-length", "48", "--batch-size", "4", "--log-every", "1")


def pairs(shift: int = 0) -> list[dict[str, str]]:
    return [
        {
            "prompt": f"Report {i + shift}: the market in town {i} opened.",
            "chosen": f" Farmers sold apples and bread at stall {i}.",
            "rejected": f" bread stall apples {i} Farmers at sold.",
        }
        for i in range(20)
    ]


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs()))
    return path


def preference(pairs_file: Path, *extra: str) -> tuple[str, ...]:
    return ("train", "--task", "preference", "--dataset", str(pairs_file), *SHORT, *extra)


def run(train_cli, *args: str) -> subprocess.CompletedProcess[str]:
    proc = train_cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def metrics(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_precompute_and_an_fp32_copy_give_the_same_losses_and_weights(
    train_cli, tmp_path, pairs_file
):
    """The same reference paid for two ways: the table computed before training and a frozen
    fp32 copy in the step give the same DPO loss at every step, the same evaluation and the same
    trained weights (within fp32: the table's batches are padded otherwise)."""
    results = {}
    for how in ("precompute", "copy"):
        out = tmp_path / how
        run(
            train_cli,
            *preference(pairs_file, "--max-steps", "3", "--reference", how),
            "--output-dir", str(out), "--metrics-json", str(out / "m.json"),
        )  # fmt: skip
        results[how] = metrics(out / "m.json"), load_tensors(out / "final")["model"]
    (pre, pre_weights), (copy, copy_weights) = results["precompute"], results["copy"]
    assert [h["step"] for h in pre["loss_history"]] == [1, 2, 3]
    for a, b in zip(pre["loss_history"], copy["loss_history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-5)
    assert pre["eval"]["loss"] == pytest.approx(copy["eval"]["loss"], rel=1e-5)
    assert pre_weights.keys() == copy_weights.keys()
    for name, tensor in pre_weights.items():
        assert tensor.allclose(copy_weights[name], atol=1e-6), name
    assert pre["reference"] == {"how": "precompute", "dtype": "fp32", "bytes": 2 * 4 * 20}
    assert copy["reference"]["how"] == "copy" and copy["reference"]["dtype"] == "fp32"
    assert copy["reference"]["bytes"] == copy["parameter_bytes"]  # a whole second model


def test_precompute_and_an_fp32_copy_give_the_same_gradients(pairs_file):
    """On one built run's first batch: the loss with the precomputed table and with a frozen
    fp32 copy, and every parameter's gradient, agree within fp32."""
    import torch

    from effitrain.build import build_run, checked_config
    from effitrain.report.live import Reporter
    from effitrain.tasks.reference_model import FrozenCopy, Precomputed
    from tests.conftest import _reset_accelerate

    _reset_accelerate()
    options = {"task": "preference", "dataset": str(pairs_file), "max_length": 48}
    run = build_run(checked_config(None, {**options, "batch_size": 4}), Reporter(quiet=True))
    try:
        assert isinstance(run.loss.reference, Precomputed)
        run.loss.reference.compute(run)
        copy = FrozenCopy(run.accelerator.unwrap_model(run.model), run.loss, run.config)
        batch = next(iter(run.train_loader))
        gradients = []
        for provider in (run.loss.reference, copy):
            run.loss.reference = provider
            run.model.zero_grad(set_to_none=True)
            loss = run.loss(run.model, batch)
            loss.backward()
            gradients.append((loss.detach(), [p.grad.clone() for p in run.model.parameters()]))
        (loss_a, grads_a), (loss_b, grads_b) = gradients
        assert abs(float(loss_a) - 0.6931) < 1e-3  # the policy is the reference: log 2
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
        assert len(grads_a) > 10
        for a, b in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    finally:
        _reset_accelerate()


@pytest.mark.slow
def test_resume_with_a_precomputed_reference_is_exact_and_does_not_recompute(
    train_cli, tmp_path, pairs_file, monkeypatch
):
    from effitrain.tasks.reference_model import TABLE_FILE, Precomputed

    passes = []
    compute = Precomputed.compute
    monkeypatch.setattr(
        Precomputed, "compute", lambda self, run: passes.append(1) or compute(self, run)
    )
    common = (*preference(pairs_file, "--max-steps", "4", "--save-every", "2"),)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run(train_cli, *common, "--output-dir", str(straight))
    assert passes == [1] and "reference: computing the log-probs of" in first.stdout
    assert (straight / "checkpoint-2" / TABLE_FILE).is_file()
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    proc = run(train_cli, *common, "--output-dir", str(resumed), "--resume", "latest")
    assert "resumed from" in proc.stdout
    assert passes == [1]  # the table came back from the checkpoint
    assert "reference: log-probs read from the checkpoint, not recomputed" in proc.stdout
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))
    assert_identical(
        load_tensors(straight / "checkpoint-4"), load_tensors(resumed / "checkpoint-4")
    )


def test_a_table_computed_on_other_data_is_refused(train_cli, tmp_path, pairs_file):
    out = tmp_path / "out"
    run(
        train_cli,
        *preference(pairs_file, "--max-steps", "2", "--save-every", "2"),
        "--output-dir", str(out),
    )  # fmt: skip
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in pairs(shift=100)))
    proc = train_cli(
        *preference(other, "--max-steps", "3", "--output-dir", str(out), "--resume", "latest")
    )
    assert_clean_error(proc, "precomputed reference log-probs", "other data")


def test_lora_with_the_adapters_switched_off_adds_no_bytes(train_cli, tmp_path, pairs_file):
    out = tmp_path / "m.json"
    proc = run(
        train_cli,
        *preference(pairs_file, "--max-steps", "2", "--lora-rank", "4"),
        "--metrics-json", str(out),
    )  # fmt: skip
    assert "adapters switched off" in proc.stdout
    measured = metrics(out)
    assert measured["reference"] == {"how": "adapters", "dtype": None, "bytes": 0}
    at_peak = measured["step_memory"]["at_peak"]
    assert at_peak["parameters"] == measured["parameter_bytes"]  # no second model anywhere
    assert at_peak["other"] == 0


def test_a_bf16_copy_is_in_the_peak(train_cli, tmp_path, pairs_file):
    out = tmp_path / "m.json"
    run(
        train_cli,
        *preference(pairs_file, "--max-steps", "2", "--reference", "copy"),
        "--reference-dtype", "bf16", "--metrics-json", str(out),
    )  # fmt: skip
    measured = metrics(out)
    copy = measured["reference"]
    assert copy["how"] == "copy" and copy["dtype"] == "bf16"
    assert copy["bytes"] == measured["parameter_bytes"] // 2  # fp32 trained, bf16 copy
    # The step probe tracks the copy's weights with the parameters.
    assert measured["step_memory"]["at_peak"]["parameters"] == (
        measured["parameter_bytes"] + copy["bytes"]
    )


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--reference", "precompute"], marks=pytest.mark.slow),
        ["--reference", "copy"],
        pytest.param(["--reference", "copy", "--reference-dtype", "bf16"], marks=pytest.mark.slow),
        pytest.param(["--reference", "copy", "--reference-dtype", "4bit"], marks=pytest.mark.slow),
        pytest.param(["--lora-rank", "4"], marks=pytest.mark.slow),
    ],
    ids=lambda options: " ".join(options),
)
def test_estimate_equals_a_run(train_cli, tmp_path, pairs_file, options):
    from effitrain.cli.compare import train_config
    from effitrain.estimation import estimate

    args = [*preference(pairs_file, "--max-steps", "2", *options)][1:]
    out = tmp_path / "m.json"
    run(train_cli, "train", *args, "--metrics-json", str(out))
    measured = metrics(out)
    estimated = estimate(train_config(args)).to_dict()
    for key in ("parameter_bytes", "gradient_bytes", "trainable_parameters", "optimizer_state"):
        assert estimated[key] == measured[key], key
    assert estimated["reference"] == measured["reference"]
    # The reference's row, and the parameters the step holds (the copy's included).
    assert (
        estimated["step_memory"]["at_peak"]["parameters"]
        == (measured["step_memory"]["at_peak"]["parameters"])
    )
    assert (
        estimated["step_memory"]["at_peak"]["other"]
        == (measured["step_memory"]["at_peak"]["other"])
    )


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["estimate", "--task", "preference", "--reference", "copy", "--num-processes", "2",
             "--sharding", "fsdp"],
            ["--reference copy", "use --reference precompute"],
        ),
        (["estimate", "--task", "preference", "--reference", "adapters"], ["--lora-rank"]),
        (
            ["estimate", "--task", "preference", "--reference", "copy", "--lora-rank", "4"],
            ["use --reference adapters"],
        ),
        (
            ["estimate", "--task", "preference", "--preference-loss", "orpo", "--reference",
             "precompute"],
            ["--reference needs --preference-loss dpo"],
        ),
        (
            ["estimate", "--task", "preference", "--reference-dtype", "bf16"],
            ["--reference-dtype needs --reference copy"],
        ),
        (["estimate", "--task", "causal-lm", "--reference", "copy"], ["--task preference"]),
    ],
    ids=[
        "copy-fsdp",
        "adapters-without-lora",
        "copy-with-lora",
        "orpo",
        "dtype-without-copy",
        "causal-lm",
    ],
)  # fmt: skip
def test_refusals_are_one_line(train_cli, args, fragments):
    assert_clean_error(train_cli(*args), *fragments)
