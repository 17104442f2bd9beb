"""Exact resume, stopping on signals, non-finite losses, and resume refusals.

Exactness: a run of 2N steps straight and a run stopped after N steps (by a real signal) then
resumed to 2N end with bit-identical weights, optimizer and scheduler state, on CPU, with
dropout on (the tiny preset keeps DistilBERT's dropout), mid-epoch and across epoch boundaries.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.checkpoint_helpers import (
    assert_identical,
    load_tensors,
    signal_self_at_step,
    train_args,
    write_data,
)
from tests.conftest import OFFLINE, assert_clean_error


@pytest.fixture
def data(tmp_path):
    return write_data(tmp_path / "data")


def straight_and_resumed(train_cli, monkeypatch, data, tmp_path, stop_after, *options):
    """Run once straight and once stopped by SIGTERM after step ``stop_after`` then resumed.

    Returns the two output folders.
    """
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = train_cli(*train_args(data, straight, *options))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    with monkeypatch.context() as patch:
        signal_self_at_step(patch, stop_after - 1)
        proc = train_cli(*train_args(data, resumed, *options))
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert f"stopped by SIGTERM after step {stop_after}" in proc.stdout
    assert (resumed / f"checkpoint-{stop_after}").is_dir()
    assert not (resumed / "final").exists()

    proc = train_cli(*train_args(data, resumed, *options, "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {resumed / f'checkpoint-{stop_after}'}" in proc.stdout
    return straight, resumed


def assert_same_end(straight, resumed, step):
    """Weights, optimizer and scheduler state at ``step`` and the final model: bit-identical."""
    compared = assert_identical(
        load_tensors(straight / f"checkpoint-{step}"), load_tensors(resumed / f"checkpoint-{step}")
    )
    assert compared > 40  # every weight and every optimizer-state tensor
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))
    meta_a = json.loads((straight / f"checkpoint-{step}" / "effitrain.json").read_text())
    meta_b = json.loads((resumed / f"checkpoint-{step}" / "effitrain.json").read_text())
    for key in ("global_step", "epoch", "step_in_epoch", "total_batches", "total_samples"):
        assert meta_a[key] == meta_b[key], key
    assert [e["step"] for e in meta_a["eval_history"]] == [
        e["step"] for e in meta_b["eval_history"]
    ]


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "adamw-8bit"])
def test_resume_mid_epoch_across_epoch_boundary_is_exact(
    train_cli, monkeypatch, data, tmp_path, optim
):
    # Stop at step 4 of a 6-step epoch; the resumed part crosses into epoch 2 and ends at 8.
    options = ("--optim", optim, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, monkeypatch, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


def test_resume_at_epoch_end_with_grad_accum_is_exact(train_cli, monkeypatch, data, tmp_path):
    # 3 optimizer steps per epoch with --grad-accum 2: stop exactly at the end of epoch 1, before
    # its evaluation; the resumed run evaluates epoch 1, then trains epoch 2 and part of 3.
    options = ("--grad-accum", "2", "--max-steps", "7", "--save-every", "2")
    straight, resumed = straight_and_resumed(train_cli, monkeypatch, data, tmp_path, 3, *options)
    assert_same_end(straight, resumed, 7)


def test_epoch_checkpoint_resumes_exactly(train_cli, data, tmp_path):
    # --save-strategy epoch writes checkpoint-6 after epoch 1's evaluation; resuming from a copy
    # of it continues with epoch 2 and matches the uninterrupted run.
    straight, other = tmp_path / "straight", tmp_path / "other"
    options = ("--max-steps", "8", "--save-strategy", "epoch")
    proc = train_cli(*train_args(data, straight, *options))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in straight.iterdir()) == ["checkpoint-6", "checkpoint-8", "final"]
    meta = json.loads((straight / "checkpoint-6" / "effitrain.json").read_text())
    assert (meta["epoch"], meta["step_in_epoch"]) == (1, 0)
    assert [e["epoch"] for e in meta["eval_history"]] == [1]

    other.mkdir()
    shutil.copytree(straight / "checkpoint-6", other / "checkpoint-6")
    proc = train_cli(*train_args(data, other, *options, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr
    assert "eval (epoch 1)" not in proc.stdout  # not evaluated again
    assert_same_end(straight, other, 8)


def test_sigterm_in_a_real_subprocess_then_resume_continues_exactly(train_cli, data, tmp_path):
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    options = ("--max-steps", "20")
    env = {k: v for k, v in os.environ.items() if k != "EFFITRAIN_DEBUG"}
    env.update({**OFFLINE, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "effitrain", *train_args(data, stopped, *options)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(lines)
    out, err = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode == 143, text + err
    assert "Traceback" not in err
    resume_lines = [line for line in text.splitlines() if line.startswith("resume with: ")]
    assert len(resume_lines) == 1, text
    command = shlex.split(resume_lines[0].removeprefix("resume with: "))
    assert command[:2] == ["effitrain", "train"] and command[-2:] == ["--resume", "latest"]
    (checkpoint,) = [p for p in stopped.iterdir() if p.name.startswith("checkpoint-")]
    step = int(checkpoint.name.split("-")[1])
    assert 3 < step < 20

    # The printed command continues the run; it ends exactly where an uninterrupted run ends.
    proc2 = train_cli(*command[1:])
    assert proc2.returncode == 0, proc2.stdout + proc2.stderr
    proc3 = train_cli(*train_args(data, straight, *options))
    assert proc3.returncode == 0, proc3.stderr
    assert_identical(load_tensors(straight / "final"), load_tensors(stopped / "final"))


def test_sigint_without_output_dir_exits_130_and_says_nothing_saved(train_cli, monkeypatch, data):
    signal_self_at_step(monkeypatch, 2, signal.SIGINT)
    args = train_args(data, data[0].parent / "unused", "--max-steps", "20")
    args = args[: args.index("--output-dir")]
    proc = train_cli(*args)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "stopped by SIGINT after step 3; nothing was saved" in proc.stdout


def _nan_on_forward(monkeypatch, call: int):
    """Make the model's loss NaN on its ``call``-th training forward; count optimizer steps."""
    import effitrain.loop as loop

    steps: list[int] = []
    original_load, original_build = loop.load_model, loop.build_optimizer

    def load_model(*args, **kwargs):
        model = original_load(*args, **kwargs)
        calls = []

        def poison(module, inputs, output):
            if module.training:
                calls.append(1)
                if len(calls) == call:
                    output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(poison)
        return model

    def build_optimizer(*args, **kwargs):
        optimizer = original_build(*args, **kwargs)
        optimizer.register_step_post_hook(lambda *_: steps.append(1))
        return optimizer

    monkeypatch.setattr(loop, "load_model", load_model)
    monkeypatch.setattr(loop, "build_optimizer", build_optimizer)
    return steps


def test_nan_loss_stops_before_the_update_and_saves_nothing_bad(
    train_cli, monkeypatch, data, tmp_path
):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "out"
    steps = _nan_on_forward(monkeypatch, call=5)
    proc = train_cli(*train_args(data, out, "--max-steps", "8", "--save-every", "2"))
    line = assert_clean_error(proc, "non-finite loss nan at step 5", "stopped before the update")
    assert "checkpoint-4" in line
    assert len(steps) == 4  # the bad update never ran
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    weights = load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_nonfinite_gradient_with_finite_loss_is_caught(train_cli, monkeypatch, data, tmp_path):
    import effitrain.loop as loop

    original = loop.load_model

    def load_model(*args, **kwargs):
        model = original(*args, **kwargs)
        model.classifier.weight.register_hook(lambda grad: grad * float("inf"))
        return model

    monkeypatch.setattr(loop, "load_model", load_model)
    proc = train_cli(*train_args(data, tmp_path / "out", "--max-steps", "3"))
    assert_clean_error(proc, "non-finite gradient norm", "at step 1")


@pytest.fixture
def adamw_checkpoint(train_cli, data, tmp_path):
    out = tmp_path / "run"
    proc = train_cli(*train_args(data, out, "--max-steps", "2", "--save-every", "2"))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (("--optim", "adafactor"), ("--optim adamw", "this run uses --optim adafactor")),
        (("--model", "small"), ("model mismatch", "shape")),
        (("--weight-decay", "0.1"), ("optimizer mismatch", "weight_decay is 0.01", "0.1")),
    ],
    ids=["optimizer", "model-shape", "hyperparameter"],
)
def test_resume_mismatch_fails_before_loading(
    train_cli, data, adamw_checkpoint, options, fragments
):
    args = train_args(data, adamw_checkpoint, "--max-steps", "4", *options, "--resume", "latest")
    assert_clean_error(train_cli(*args), *fragments)


def test_resume_from_incomplete_or_corrupt_checkpoint(train_cli, data, adamw_checkpoint):
    checkpoint = adamw_checkpoint / "checkpoint-2"
    args = train_args(data, adamw_checkpoint, "--max-steps", "4", "--resume")

    optimizer_file = checkpoint / "optimizer.bin"
    good = optimizer_file.read_bytes()
    optimizer_file.write_bytes(b"XXXX" + good[4:])  # same size, broken content
    assert_clean_error(train_cli(*args, str(checkpoint)), "cannot load checkpoint")

    optimizer_file.write_bytes(good[: len(good) // 2])  # truncated
    assert_clean_error(
        train_cli(*args, str(checkpoint)), "incomplete or corrupt", "optimizer.bin has"
    )
    # `latest` skips it, finds nothing else and says so.
    assert_clean_error(train_cli(*args, "latest"), "no complete checkpoint")

    (checkpoint / "effitrain.json").unlink()
    assert_clean_error(train_cli(*args, str(checkpoint)), "not a complete effitrain checkpoint")
    assert_clean_error(train_cli(*args, str(checkpoint.parent / "nope")), "checkpoint not found")


def test_resuming_a_finished_run_only_reports(train_cli, data, adamw_checkpoint):
    args = train_args(data, adamw_checkpoint, "--max-steps", "2", "--save-every", "2")
    proc = train_cli(*args, "--resume", "latest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "already at step 2 of 2" in proc.stdout and "done · 2 steps" in proc.stdout
