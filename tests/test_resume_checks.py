"""A resume trusts nothing it has not checked, and says what it skipped (docs/checkpoints.md).

Each test copies one finished run (``saved_run``: checkpoint-3, checkpoint-4 and final/ of a
4-step run) and breaks it the way a hostile but realistic user could: a renamed folder with
edited metadata, files mixed from another checkpoint, a truncated optimizer file, an unreadable
RNG state, a changed learning rate, a shorter run into a finished folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error


@pytest.fixture
def out(saved_run, tmp_path) -> Path:
    """A copy of the finished run's folder, to break."""
    return Path(shutil.copytree(saved_run.out, tmp_path / "out"))


def resume(train_cli, saved_run, out: Path, *extra: str):
    return train_cli(
        *train_args(saved_run.data, out, *saved_run.options, *extra, "--resume", "latest")
    )


def edit_metadata(folder: Path, **changes) -> None:
    path = folder / "effitrain.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_a_renamed_folder_with_edited_metadata_is_refused_and_final_is_kept(
    train_cli, saved_run, out
):
    """The hostile probe: checkpoint-3 renamed to checkpoint-999, its metadata's step edited to
    match. The scheduler and the optimizer counted 3 steps: the resume is refused, and final/
    (step 4's model) is not replaced by step 3's."""
    final = (out / "final" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-3").rename(out / "checkpoint-999")
    edit_metadata(out / "checkpoint-999", global_step=999)
    line = assert_clean_error(resume(train_cli, saved_run, out), "checkpoint-999 is inconsistent")
    assert "says step 999" in line and "scheduler has stepped 3 times" in line, line
    assert (out / "final" / "model.safetensors").read_bytes() == final


def test_a_folder_name_that_disagrees_with_its_metadata_is_refused(train_cli, saved_run, out):
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-3").rename(out / "checkpoint-7")
    assert_clean_error(
        resume(train_cli, saved_run, out),
        "its folder name says step 7, its effitrain.json step 3",
    )


def test_an_optimizer_state_from_another_checkpoint_is_refused(train_cli, saved_run, out):
    """checkpoint-3's optimizer.bin copied into checkpoint-4 (its size fixed in the metadata, so
    the file check passes): the loaded optimizer counted 3 steps, the metadata recorded 4."""
    (out / "checkpoint-4" / "optimizer.bin").write_bytes(
        (out / "checkpoint-3" / "optimizer.bin").read_bytes()
    )
    meta = json.loads((out / "checkpoint-4" / "effitrain.json").read_text())
    meta["files"]["optimizer.bin"] = (out / "checkpoint-4" / "optimizer.bin").stat().st_size
    edit_metadata(out / "checkpoint-4", files=meta["files"])
    assert_clean_error(
        resume(train_cli, saved_run, out, "--max-steps", "6"),
        "checkpoint-4 is inconsistent",
        "optimizer steps are 3, recorded 4",
    )


def test_a_corrupt_newest_checkpoint_is_named_and_the_one_used_instead_said(
    train_cli, saved_run, out
):
    (out / "checkpoint-4" / "optimizer.bin").write_bytes(b"cut short")
    shutil.rmtree(out / "final")
    proc = resume(train_cli, saved_run, out)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note:")]
    assert any(
        "checkpoint-4 is incomplete or corrupt: optimizer.bin has 9 bytes" in note
        and "skipped; resuming from checkpoint-3" in note
        for note in notes
    ), proc.stdout
    assert f"resumed from {out / 'checkpoint-3'}" in proc.stdout


def test_an_unreadable_random_state_is_said_without_library_warnings(train_cli, saved_run, out):
    """The RNG file keeps its size (the file check passes) but cannot be read: Accelerate would
    go on without it, saying nothing; the resume says it is not exact."""
    path = out / "checkpoint-4" / "random_states_0.pkl"
    path.write_bytes(b"\0" * path.stat().st_size)
    shutil.rmtree(out / "final")
    proc = resume(train_cli, saved_run, out, "--max-steps", "5")
    assert proc.returncode == 0, proc.stderr
    assert "random_states_0.pkl cannot be read" in proc.stdout
    assert "not an exact continuation" in proc.stdout
    assert "Warning" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "option,fragment",
    [
        (("--lr", "0.5"), "--lr is 0.5 in this run but was 0.0002"),
        pytest.param(
            ("--scheduler", "cosine"),
            "--scheduler is cosine in this run but was linear",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("--warmup-steps", "2"),
            "--warmup-steps is 2 in this run but was 1",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["lr", "scheduler", "warmup"],
)
def test_a_changed_schedule_on_resume_is_refused(train_cli, saved_run, out, option, fragment):
    """The restored scheduler would keep the checkpoint's lr, whatever --lr says (and the new
    checkpoint would record the new one): refused, as a changed weight decay is."""
    shutil.rmtree(out / "final")
    line = assert_clean_error(resume(train_cli, saved_run, out, *option), fragment)
    assert "a resumed run continues the checkpoint's lr schedule" in line


def test_a_longer_run_is_taken_and_said(train_cli, saved_run, out):
    proc = resume(train_cli, saved_run, out, "--max-steps", "6", "--warmup-steps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "the schedule now runs to step 6 (the checkpoint's run: 4)" in proc.stdout
    meta = json.loads((out / "final" / "effitrain.json").read_text())
    assert meta == {"format": "effitrain-final", "global_step": 6}


def test_final_is_never_replaced_by_an_earlier_model(train_cli, saved_run, out):
    """Resuming checkpoint-3 for a 3-step run would replace final/ (step 4) with an earlier
    model: refused before training."""
    final = (out / "final" / "model.safetensors").read_bytes()
    proc = train_cli(
        *train_args(saved_run.data, out, "--save-every", "3", "--max-steps", "3"),
        "--resume",
        str(out / "checkpoint-3"),
        "--warmup-steps",
        "1",
    )
    assert_clean_error(proc, "holds the model of step 4, and this run ends at step 3")
    assert (out / "final" / "model.safetensors").read_bytes() == final


def test_a_new_run_does_not_replace_a_trained_model(train_cli, saved_run, out):
    for checkpoint in out.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    assert_clean_error(
        train_cli(*train_args(saved_run.data, out, "--max-steps", "1")),
        "already holds a trained model",
    )


def test_a_full_disk_in_torchs_own_words_is_one_line(monkeypatch, tmp_path):
    """torch reports a full disk during a save as ``RuntimeError: [enforce fail at
    inline_container.cc…] . unexpected pos``: said as what it is, and what is intact."""
    import shutil as shutil_module
    from types import SimpleNamespace

    import effitrain.checkpoint.saving as saving
    from effitrain.checkpoint import save_checkpoint
    from effitrain.errors import EffitrainError

    class Accelerator:
        is_main_process, num_processes = True, 1

        def wait_for_everyone(self):
            pass

        def save_state(self, folder):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    monkeypatch.setattr(saving, "find_latest", lambda folder: out / "checkpoint-2")
    full = SimpleNamespace(total=10**9, used=10**9, free=0)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: full)
    with pytest.raises(EffitrainError) as error:
        save_checkpoint(Accelerator(), out, {"global_step": 4}, keep=None)
    assert str(error.value) == (
        f"no space left on device while saving checkpoint-4 in {out}; checkpoint-2 is intact"
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


def test_a_write_error_with_room_on_the_disk_says_torchs_first_line(monkeypatch, tmp_path):
    from effitrain.checkpoint import write_failure

    error = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert write_failure(error, tmp_path) == (
        "could not write (PytorchStreamWriter failed writing file data/0: file write failed)"
    )
