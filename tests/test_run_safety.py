"""One run per output folder (its lock: refused while the owner lives, taken over once it is
dead, released however the run ends), a signal before the first step, checkpoint metadata of
the wrong types, a symlinked checkpoint's rotation, and the note of a run that keeps no
model."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error

LOCK = ".effitrain.lock"
SINCE = "2026-12-06 13:00:00 UTC"


def write_lock(folder, pid: int, host: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"pid": pid, "host": host or socket.gethostname(), "since": SINCE}
    (folder / LOCK).write_text(json.dumps(record) + "\n")


@pytest.fixture
def live_pid():
    """The PID of a process that lives for the test."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait()


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that has ended."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


@pytest.mark.parametrize("resume", [False, True], ids=["new run", "resume latest"])
def test_a_folder_held_by_a_live_run_is_refused_and_left_alone(
    train_cli, data, saved_run, tmp_path, live_pid, resume
):
    import shutil

    out = tmp_path / "out"
    if resume:
        shutil.copytree(saved_run.out, out)
    write_lock(out, live_pid)
    before = sorted(p.name for p in out.iterdir())
    extra = ("--max-steps", "6", "--resume", "latest") if resume else ("--max-steps", "2")
    proc = train_cli(*train_args(data, out, *extra))
    assert_clean_error(
        proc,
        f"--output-dir {out} is in use by another effitrain run "
        f"(PID {live_pid} on {socket.gethostname()}, since {SINCE}); wait for it to end",
    )
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    assert json.loads((out / LOCK).read_text())["pid"] == live_pid


def test_a_lock_from_another_host_is_refused_with_how_to_remove_it(
    train_cli, data, tmp_path, dead_pid
):
    out = tmp_path / "out"
    write_lock(out, dead_pid, host="elsewhere.example")
    proc = train_cli(*train_args(data, out, "--max-steps", "2"))
    assert_clean_error(
        proc,
        f"is in use by an effitrain run on another host (PID {dead_pid} on elsewhere.example",
        f"if that run is no longer running, delete {out / LOCK}",
    )
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_a_dead_runs_lock_is_taken_over_with_a_note_then_released(
    train_cli, data, tmp_path, dead_pid
):
    out = tmp_path / "out"
    write_lock(out, dead_pid)
    proc = train_cli(*train_args(data, out, "--max-steps", "2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        f"note: {out}: took over the lock of PID {dead_pid} on {socket.gethostname()}, since "
        f"{SINCE}, which is no longer running" in proc.stdout
    )
    assert (out / "final").is_dir() and not (out / LOCK).exists()


def test_the_lock_is_released_after_an_error_and_after_a_stop(
    train_cli, data, tmp_path, monkeypatch
):
    from effitrain.signals import StopRequest

    train, _, model = data
    failed = tmp_path / "failed"
    failed.mkdir()
    broken = tmp_path / "broken.jsonl"  # refused as the data loads, under the lock
    broken.write_text('{"sentence": "a", "label": 0}\n{"sentence": \n')
    proc = train_cli(
        "train", "--model", str(model), "--train-file", str(train), "--validation-file",
        str(broken), "--output-dir", str(failed),
    )  # fmt: skip
    assert_clean_error(proc, "broken.jsonl")
    assert list(failed.iterdir()) == []
    created = tmp_path / "new" / "out"  # made for the lock, removed with it: nothing else came
    proc = train_cli(*train_args(data, created, "--validation-file", str(broken)))
    assert_clean_error(proc, "broken.jsonl")
    assert not created.exists()

    def requested(self) -> bool:  # a SIGTERM arrives during step 1
        self.signum = signal.SIGTERM
        return True

    monkeypatch.setattr(StopRequest, "requested", property(requested))
    stopped = tmp_path / "stopped"
    proc = train_cli(*train_args(data, stopped, "--max-steps", "2"))
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert sorted(p.name for p in stopped.iterdir()) == ["checkpoint-1"]


@pytest.fixture
def sigterm_to_the_run():
    """A SIGTERM that the run under test does not handle fails the test (instead of ending
    pytest, as the default handler would)."""

    def not_handled(signum, frame):
        raise RuntimeError("SIGTERM was not handled by the run")

    previous = signal.signal(signal.SIGTERM, not_handled)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_after_the_last_step_stops_in_one_line(
    train_cli, data, tmp_path, monkeypatch, sigterm_to_the_run
):
    """The final model's save: a SIGTERM there stops at once, says so, and frees the folder."""
    import os

    import effitrain.checkpoint

    save_final = effitrain.checkpoint.save_final

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return save_final(*args, **kwargs)

    monkeypatch.setattr(effitrain.checkpoint, "save_final", terminated)
    out = tmp_path / "out"
    proc = train_cli(*train_args(data, out, "--max-steps", "2", "--save-every", "2"))
    assert proc.returncode == 143, proc.stdout + proc.stderr
    line = (
        f"stopped by SIGTERM after its last step (2), before the run finished; last checkpoint: "
        f"{out / 'checkpoint-2'}"
    )
    assert line in proc.stdout.splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


def test_sigterm_during_the_reference_pass_stops_in_one_line(
    train_cli, tmp_path, monkeypatch, sigterm_to_the_run
):
    """DPO's precomputed reference: a SIGTERM in its pass (before any step) ends the run with
    the stopped line and 128 + 15, and releases the folder."""
    import os

    import effitrain.tasks.reference_model as reference

    rows = [
        {"prompt": f"Report {i}:", "chosen": f" apples at stall {i}.", "rejected": f" stall {i}."}
        for i in range(12)
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored_logps = reference._scored_logps

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return scored_logps(*args, **kwargs)

    monkeypatch.setattr(reference, "_scored_logps", terminated)
    out = tmp_path / "out"
    proc = train_cli(
        "train", "--task", "preference", "--dataset", str(pairs), "--max-length", "32",
        "--batch-size", "4", "--reference", "precompute", "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "stopped by SIGTERM before training; nothing was saved" in proc.stdout.splitlines()
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("key", "value", "wanted"),
    [
        ("global_step", "4", "an integer"),
        ("config", [], "an object"),
        ("window", 3, "a list"),
        ("optimizer.name", 3, "a string"),
        ("window", ["a", 0.0, 0.0, 0.0], "a list of numbers"),
        ("schedule.warmup_steps", "x", "an integer"),
    ],
)
def test_metadata_of_the_wrong_type_is_one_line_naming_file_and_key(
    train_cli, saved_run, tmp_path, key, value, wanted
):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(saved_run.out, out)
    meta_file = out / "checkpoint-4" / "effitrain.json"
    meta = json.loads(meta_file.read_text())
    *parents, name = key.split(".")
    holder = meta
    for parent in parents:
        holder = holder[parent]
    holder[name] = value
    meta_file.write_text(json.dumps(meta))
    proc = train_cli(
        *train_args(saved_run.data, out, "--max-steps", "6", "--resume", str(out / "checkpoint-4"))
    )
    assert_clean_error(proc, f"{meta_file}: {key} is {json.dumps(value)}, not {wanted}")


def test_a_run_without_output_dir_says_its_model_is_not_kept(train_cli, data):
    train, validation, model = data
    common = ("train", "--model", str(model), "--train-file", str(train), "--max-steps", "1")
    proc = train_cli(*common, "--validation-file", str(validation))
    assert proc.returncode == 0, proc.stderr
    note = "the trained model is not saved (no --output-dir); add --output-dir DIR to keep it"
    assert note in proc.stdout
    quiet = train_cli(*common, "--validation-file", str(validation), "--quiet")
    assert note not in quiet.stdout


def test_a_symlinked_checkpoint_is_rotated_as_a_link(train_cli, saved_run, tmp_path):
    """--save-total-limit counts a linked checkpoint and removes the link, never what it points
    to (a folder elsewhere is not this output folder's to delete)."""
    import shutil

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    shutil.copytree(saved_run.out, out)
    elsewhere.mkdir()
    shutil.move(out / "checkpoint-3", elsewhere / "checkpoint-3")
    (out / "checkpoint-3").symlink_to(elsewhere / "checkpoint-3", target_is_directory=True)
    kept = sorted(p.name for p in (elsewhere / "checkpoint-3").iterdir())
    proc = train_cli(
        *train_args(saved_run.data, out, "--max-steps", "6", "--save-every", "1"),
        "--save-total-limit", "2", "--resume", "latest",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5", "checkpoint-6", "final"]
    assert sorted(p.name for p in (elsewhere / "checkpoint-3").iterdir()) == kept
