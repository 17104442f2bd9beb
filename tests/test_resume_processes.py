"""A resume on another process count continues the same run: the global batch kept by the
accumulation (or refused in one line), the lr schedule carried over to the new process count,
the warmup the first run derived kept, and checkpoints written under FSDP told apart from the
others. The two-process runs themselves are in test_distributed.py (DDP) and
test_fsdp2_optim.py (FSDP2); here are the rules, on metadata and on one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from effitrain.checkpoint import continue_schedule, continued_config
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error

CHECKPOINT = Path("out/checkpoint-6")
WRITTEN = "the checkpoint was written by 2 process(es), this run has 1"


def meta(world: int, batch: int, accum: int, warmup: int | None = None, derived: int = 1):
    """The metadata fields the rules read: a run of ``world`` x ``batch`` x ``accum``."""
    return {
        "world_size": world,
        "config": {"batch_size": batch, "grad_accum": accum, "warmup_steps": warmup},
        "schedule": {"warmup_steps": warmup if warmup is not None else derived},
    }


def test_one_process_keeps_a_two_process_global_batch_by_accumulating():
    config, notes = continued_config(TrainConfig(batch_size=8), meta(2, 8, 1), CHECKPOINT, 1)
    assert config.grad_accum == 2 and config.batch_size == 8
    assert notes == [
        "the checkpoint was written by 2 process(es), this run has 1: --grad-accum 2 keeps its "
        "global batch of 16 (2 x 8 x 1 before)"
    ]
    # Two processes back from one process accumulating 4 x 2.
    config, _ = continued_config(
        TrainConfig(batch_size=4, grad_accum=4), meta(1, 4, 4), CHECKPOINT, 2
    )
    assert config.grad_accum == 2


def test_a_global_batch_already_kept_is_left_alone():
    for batch, accum in ((8, 2), (16, 1)):  # the accumulation doubled, or the batch instead
        given = TrainConfig(batch_size=batch, grad_accum=accum, warmup_steps=1)
        kept = continued_config(given, meta(2, 8, 1), CHECKPOINT, 1)
        assert kept == (
            given,
            [f"{WRITTEN}: the same global batch of 16, its lr schedule continued"],
        )


@pytest.mark.parametrize(
    ("config", "saved", "processes", "way"),
    [
        # 1 x 8 x 1 cannot be split into 2 x 8 x (1/2): a smaller per-process batch keeps it.
        (TrainConfig(batch_size=8), meta(1, 8, 1), 2, "with --batch-size 4 --grad-accum 1 to keep"),
        (TrainConfig(batch_size=8), meta(2, 8, 1), 3, "3 processes cannot split it evenly"),
        # The user's own accumulation, which makes another global batch, is not overruled.
        (
            TrainConfig(batch_size=8, grad_accum=4),
            meta(2, 8, 1),
            1,
            "--batch-size 8 --grad-accum 2",
        ),
    ],
)
def test_a_global_batch_that_cannot_be_kept_is_refused(config, saved, processes, way):
    with pytest.raises(EffitrainError) as raised:
        continued_config(config, saved, CHECKPOINT, processes)
    message = str(raised.value)
    assert "\n" not in message and "was trained with a global batch of" in message
    assert way in message


def test_a_derived_warmup_stays_the_checkpoints_and_a_given_one_is_kept():
    config, notes = continued_config(TrainConfig(), meta(1, 16, 1, derived=120), CHECKPOINT, 1)
    assert config.warmup_steps == 120 and notes == []
    given = TrainConfig(warmup_steps=5)  # the user's: check_schedule compares it
    assert continued_config(given, meta(1, 16, 1, derived=120), CHECKPOINT, 1)[0] == given
    saved_given = meta(1, 16, 1, warmup=30)
    assert continued_config(TrainConfig(), saved_given, CHECKPOINT, 1)[0].warmup_steps is None


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_the_schedule_continues_at_the_same_optimizer_step(before, after):
    """Accelerate's prepared scheduler steps once per process per optimizer step: a position
    saved by ``before`` processes becomes the same optimizer step counted in ``after``."""
    import torch

    from effitrain.optim import build_scheduler

    def scheduler(processes: int):
        weight = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        return build_scheduler(optimizer, "linear", 10 * processes, 2 * processes)

    saved = scheduler(before)
    for _ in range(6 * before):  # 6 optimizer steps
        saved.optimizer.step()
        saved.step()
    resumed = scheduler(after)
    resumed.load_state_dict(saved.state_dict())
    continue_schedule(resumed, {"world_size": before}, after)
    straight = scheduler(after)
    for _ in range(6 * after):
        straight.optimizer.step()
        straight.step()
    assert resumed.last_epoch == straight.last_epoch == 6 * after
    assert resumed.get_last_lr() == pytest.approx(straight.get_last_lr())
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 4 / 8)
    for _ in range(2 * after):  # and it keeps going as the straight one does
        resumed.step()
        straight.step()
    assert resumed.get_last_lr() == pytest.approx(straight.get_last_lr())


def copy_run(saved_run, folder: Path, step: int = 3) -> Path:
    folder.mkdir()
    shutil.copytree(saved_run.out / f"checkpoint-{step}", folder / f"checkpoint-{step}")
    return folder


def test_a_checkpoint_saved_under_fsdp_is_refused_by_one_process(train_cli, saved_run, tmp_path):
    """Accelerate writes an FSDP run's model as ``pytorch_model_fsdp_0`` (sharded); one process
    or DDP cannot load it, and says how to resume (it was 280 lines and 11 tracebacks)."""
    out = copy_run(saved_run, tmp_path / "out")
    (out / "checkpoint-3" / "pytorch_model_fsdp_0").mkdir()
    proc = train_cli(*train_args(saved_run.data, out, *saved_run.options, "--resume", "latest"))
    assert_clean_error(proc, "was saved under FSDP", "only an FSDP launch can load it", "any N")


@pytest.mark.slow
def test_a_derived_warmup_does_not_refuse_a_longer_run(train_cli, saved_run, tmp_path):
    """The first run's 4 steps gave warmup ceil(4 x ratio); 40 steps would give more, but the
    warmup done cannot change: the resume keeps it instead of refusing --warmup-steps."""
    out = copy_run(saved_run, tmp_path / "out")
    proc = train_cli(*train_args(saved_run.data, out, "--max-steps", "40", "--resume", "latest"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the schedule now runs to step 40" in proc.stdout
    saved = json.loads((out / "checkpoint-3" / "effitrain.json").read_text())["schedule"]
    assert f"{saved['warmup_steps']} warmup" in proc.stdout


def test_final_is_not_replaced_by_an_earlier_model_when_its_stamp_is_gone(
    train_cli, saved_run, tmp_path
):
    """``final/`` without its ``effitrain.json``: the newest checkpoint bounds its step, so a
    resume ending before it cannot overwrite a later model."""
    out = tmp_path / "out"
    shutil.copytree(saved_run.out, out)
    (out / "final" / "effitrain.json").unlink()
    before = (out / "final" / "model.safetensors").read_bytes()
    proc = train_cli(
        *train_args(saved_run.data, out, "--max-steps", "3", "--resume", str(out / "checkpoint-3"))
    )
    assert_clean_error(proc, "final", "step 4", "earlier model")
    assert (out / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_the_train_loss_weighs_every_step_alike_when_a_resume_splits_the_batch(
    train_cli, data, tmp_path
):
    """The checkpoint's loss sums count micro-batches: resumed as 2 x half-batches per step (the
    same global batch), its steps would weigh half as much as the new ones (0.7037 -> 0.7076 on
    the demo). Without dropout the resumed run's train loss is the uninterrupted one's."""
    from tests.checkpoint_helpers import BATCH, save_tiny_model

    inputs = (data[0], data[1], save_tiny_model(tmp_path / "model", dropout=0.0))
    losses = []
    for name, extra in (
        ("whole", ()),
        ("split", ("--batch-size", str(BATCH // 2), "--grad-accum", "2", "--resume")),
    ):
        resume = (str(tmp_path / "whole" / "checkpoint-2"),) if extra else ()
        metrics = tmp_path / f"{name}.json"
        proc = train_cli(
            *train_args(inputs, tmp_path / name, "--max-steps", "4", "--save-every", "2"),
            *extra,
            *resume,
            "--metrics-json",
            str(metrics),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses.append(json.loads(metrics.read_text())["train_loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


@pytest.mark.slow
def test_a_resume_over_its_budget_is_offered_what_it_can_resume_with(
    train_cli, saved_run, tmp_path
):
    """``--max-memory`` refused a resume with the plan's best configuration, another optimizer,
    which the resume then refused; the advice keeps the checkpoint's optimizer, and taking it
    resumes."""
    import shlex

    out = copy_run(saved_run, tmp_path / "out")
    args = train_args(saved_run.data, out, *saved_run.options, "--resume", "latest")
    estimated = train_cli("estimate", *args[1:], "--json")
    assert estimated.returncode == 0, estimated.stderr
    budget = f"{json.loads(estimated.stdout)['peak_tensor_bytes'] - 1}B"
    line = assert_clean_error(train_cli(*args, "--max-memory", budget), "this fits")
    advice = shlex.split(line.split("): ", 1)[1])
    assert advice[advice.index("--optim") + 1] == "adamw", line
    proc = train_cli(*args, *advice, "--max-memory", budget)
    assert proc.returncode == 0, proc.stdout + proc.stderr
