"""Checkpoints: layout and metadata, all-or-nothing saves, rotation, leftovers, final model."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest

from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error


def test_layout_metadata_and_final_model(saved_run):
    out, proc = saved_run.out, saved_run.proc
    assert f"checkpoint saved: {out / 'checkpoint-3'}" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-4", "final"]
    assert {p.name for p in (out / "checkpoint-3").iterdir()} == {
        "effitrain.json",
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "random_states_0.pkl",
    }
    # The metadata is plain JSON: readable by a process that has no torch.
    code = (
        "import json, sys; meta = json.load(open(sys.argv[1])); "
        "print(meta['global_step'], meta['epoch'], meta['step_in_epoch'], "
        "meta['optimizer']['name'], meta['optimizer']['class'], meta['world_size'], "
        "'torch' in sys.modules)"
    )
    proc2 = subprocess.run(
        [sys.executable, "-c", code, str(out / "checkpoint-3" / "effitrain.json")],
        capture_output=True,
        text=True,
    )
    assert proc2.stdout.split() == ["3", "0", "3", "adamw", "torch.optim.AdamW", "1", "False"]
    meta = json.loads((out / "checkpoint-3" / "effitrain.json").read_text())
    assert meta["optimizer"]["param_groups"][0]["weight_decay"] == 0.01
    assert meta["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.999]
    assert meta["config"]["save_every"] == 3 and meta["config"]["optim"] == "adamw"
    assert {"torch", "transformers", "accelerate", "effitrain"} <= set(meta["versions"])
    assert meta["files"]["optimizer.bin"] == (out / "checkpoint-3" / "optimizer.bin").stat().st_size
    assert len(meta["optimizer"]["param_names"]) == 40


def test_final_folder_loads_with_plain_transformers(saved_run):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = saved_run.out
    final = out / "final"
    assert (final / "model.safetensors").is_file()
    assert not (final / "pytorch_model.bin").exists()
    model = AutoModelForSequenceClassification.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    trained = load_file(out / "checkpoint-4" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in trained:
            assert torch.equal(tensor, trained[name]), name
    logits = model(**tokenizer(["a great film"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)


def _failing_save_state(monkeypatch, fail_on_call: int):
    """Make accelerator.save_state write a partial file, then fail as a full disk would."""
    from accelerate import Accelerator

    original = Accelerator.save_state
    calls = []

    def save_state(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == fail_on_call:
            with open(f"{output_dir}/optimizer.bin", "wb") as handle:
                handle.write(b"PK\x03\x04 half of a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    return calls


@pytest.mark.slow
def test_full_disk_during_save_keeps_previous_checkpoint(train_cli, monkeypatch, data, tmp_path):
    out = tmp_path / "out"
    args = train_args(data, out, "--max-steps", "6", "--save-every", "2", "--save-total-limit", "1")
    with monkeypatch.context() as patch:
        calls = _failing_save_state(patch, fail_on_call=2)
        proc = train_cli(*args)
    assert calls[1].endswith(".tmp-checkpoint-4")  # written aside, never in place
    assert_clean_error(
        proc, "no space left on device while saving checkpoint-4", "checkpoint-2 is intact"
    )
    # Rotation did not run: the last good checkpoint is there and nothing half-written is.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]

    proc = train_cli(*args, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {out / 'checkpoint-2'}" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6", "final"]


@pytest.mark.slow
def test_killed_save_leftovers_are_ignored_and_cleaned(train_cli, data, tmp_path):
    out = tmp_path / "out"
    args = train_args(data, out, "--max-steps", "6", "--save-every", "2")
    proc = train_cli(*train_args(data, out, "--max-steps", "6", "--save-every", "2"))
    assert proc.returncode == 0, proc.stderr
    # What kill -9 in the middle of saves can leave: a temporary folder, and checkpoint folders
    # that are not complete (copied half-way, or a file cut short).
    leftover = out / ".tmp-checkpoint-8"
    leftover.mkdir()
    (leftover / "optimizer.bin").write_bytes(b"partial")
    (out / "checkpoint-10").mkdir()
    (out / "checkpoint-10" / "model.safetensors").write_bytes(b"partial")
    truncated = out / "checkpoint-6" / "optimizer.bin"
    truncated.write_bytes(truncated.read_bytes()[:100])

    proc = train_cli(*args[:-4], "--max-steps", "8", "--save-every", "2", "--resume", "latest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {out / 'checkpoint-4'}" in proc.stdout
    assert not leftover.exists()
    assert (out / "checkpoint-8" / "effitrain.json").is_file()


def test_rotation_keeps_the_newest(train_cli, data, tmp_path):
    out = tmp_path / "out"
    args = train_args(data, out, "--max-steps", "8", "--save-every", "2", "--save-total-limit", "2")
    proc = train_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6", "checkpoint-8", "final"]


def test_rotate_never_deletes_the_one_just_written(tmp_path):
    from effitrain.checkpoint import METADATA_FILE, rotate

    def fake(step: int):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        meta = {"format": "effitrain-checkpoint", "version": 1, "files": {"model.safetensors": 1}}
        (folder / METADATA_FILE).write_text(json.dumps(meta))
        return folder

    old_high, newest = fake(100), fake(3)  # e.g. a stale folder with a higher step number
    rotate(tmp_path, keep=1, newest=newest)
    assert newest.exists() and not old_high.exists()


def test_new_run_refuses_a_folder_with_checkpoints(train_cli, saved_run):
    out = saved_run.out
    args = train_args(saved_run.data, out, *saved_run.options)
    assert_clean_error(train_cli(*args), "already holds checkpoints", "--resume latest")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-4", "final"]


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (("--save-every", "5"), "add --output-dir"),
        (("--save-strategy", "epoch"), "add --output-dir"),
        (("--save-strategy", "often"), "unknown --save-strategy 'often'"),
        (("--save-every", "0", "--output-dir", "x"), "--save-every must be greater than 0"),
        (("--save-every", "5", "--save-strategy", "no", "--output-dir", "x"), "contradicts"),
        (("--resume", "latest"), "--resume latest needs --output-dir"),
    ],
)
def test_checkpoint_option_errors(train_cli, options, fragment):
    assert_clean_error(train_cli("train", *options), fragment)
