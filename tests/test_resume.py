"""Exact resume through the CLI, a real SIGTERM, and resume refusals.

Exactness: a straight run that saves at step N, and a second run resumed from a copy of that
checkpoint, end with bit-identical weights, optimizer and scheduler state, on CPU, with dropout
on (the test model keeps DistilBERT's dropout), mid-epoch and across epoch boundaries. Stops at
an epoch end, NaN losses and signals mid-step are tested through the loop's seams in
test_loop.py; here a real signal goes to a real process.
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
    train_args,
)
from tests.conftest import OFFLINE, assert_clean_error


def straight_and_resumed(train_cli, data, tmp_path, resume_at, *options):
    """Run straight (saving at ``resume_at``), then resume a copy of checkpoint-``resume_at``
    in a new folder to the same end. Returns the two output folders."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = train_cli(*train_args(data, straight, *options))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed.mkdir()
    shutil.copytree(straight / f"checkpoint-{resume_at}", resumed / f"checkpoint-{resume_at}")
    proc = train_cli(*train_args(data, resumed, *options, "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {resumed / f'checkpoint-{resume_at}'}" in proc.stdout
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


@pytest.mark.parametrize(
    "optim",
    [
        "adamw",
        # Other optimizers' state round trips: the full suite (adamw-8bit's is also in the fast
        # tier through test_fp32_embedding_state's resume).
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in ("adafactor", "adamw-8bit", "adam-mini")
        ),
    ],
)
def test_resume_mid_epoch_across_epoch_boundary_is_exact(train_cli, data, tmp_path, optim):
    # Resume at step 4 of a 6-step epoch; the resumed part crosses into epoch 2 and ends at 8.
    options = ("--optim", optim, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


@pytest.mark.slow
def test_resume_with_grad_accum_across_epochs_is_exact(train_cli, data, tmp_path):
    # 3 optimizer steps of 2 micro-batches per epoch: resume at step 2 (mid-epoch 1), then
    # finish epoch 1, train epoch 2 and part of 3.
    options = ("--grad-accum", "2", "--max-steps", "7", "--save-every", "2")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 2, *options)
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


@pytest.mark.slow
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


@pytest.fixture
def adamw_checkpoint(saved_run, tmp_path):
    """A copy of the shared finished run's output folder that a test may change."""
    copy = tmp_path / "run"
    shutil.copytree(saved_run.out, copy)
    return copy


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (("--optim", "adafactor"), ("--optim adamw", "this run uses --optim adafactor")),
        (("--model", "small"), ("model mismatch", "shape")),
        (("--weight-decay", "0.1"), ("optimizer mismatch", "weight_decay is 0.01", "0.1")),
    ],
    ids=["optimizer", "model-shape", "hyperparameter"],
)
def test_resume_mismatch_fails_before_loading(train_cli, saved_run, options, fragments):
    args = train_args(saved_run.data, saved_run.out, *saved_run.options, *options)
    assert_clean_error(train_cli(*args, "--resume", "latest"), *fragments)


def test_resume_from_incomplete_or_corrupt_checkpoint(train_cli, saved_run, adamw_checkpoint):
    shutil.rmtree(adamw_checkpoint / "checkpoint-3")
    checkpoint = adamw_checkpoint / "checkpoint-4"
    args = train_args(saved_run.data, adamw_checkpoint, *saved_run.options, "--resume")

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


def test_resuming_a_finished_run_only_reports(train_cli, saved_run, adamw_checkpoint):
    args = train_args(saved_run.data, adamw_checkpoint, *saved_run.options)
    proc = train_cli(*args, "--resume", "latest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "already at step 4 of 4" in proc.stdout and "done · 4 steps" in proc.stdout
    assert "eval (" not in proc.stdout  # its last evaluation came from the checkpoint
