"""Optimizer step in backward (``--optimizer-in-backward``): the updates happen inside backward
and free each gradient, they equal a normal run's when clipping is off, the one shared scheduler
drives them, the state is counted, checkpointed, inspected and resumed bit-exactly, and every
combination that cannot work is refused with one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from effitrain.build import checked_config
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.progress import TrainingProgress
from tests.checkpoint_helpers import assert_identical, load_tensors, train_args
from tests.conftest import assert_clean_error
from tests.test_loop import first_batch, fresh_accelerate, guard_for, reset_accelerate, tiny_run
from tests.test_resume import assert_same_end, straight_and_resumed

__all__ = ["fresh_accelerate"]  # the autouse fixture, imported so it applies here too

OPTIMIZERS = ["adamw", "adafactor", "adafactor-hf", "sgd", "adamw-8bit"]


def lever_config(**extra) -> TrainConfig:
    options = {"batch_size": 4, "max_steps": 6, "warmup_steps": 2, "log_every": 1}
    return TrainConfig(**{**options, "optimizer_in_backward": True, **extra})


def train_steps(run, steps: int) -> None:
    from effitrain.loop import train_step

    guard, progress = guard_for(run), TrainingProgress()
    batches = iter(run.train_loader)
    for _ in range(steps):
        train_step(run, next(batches), progress, guard)
        progress.step_done()


def inner(run):
    """The InBackwardOptimizer inside Accelerate's AcceleratedOptimizer."""
    from effitrain.optim.in_backward import InBackwardOptimizer

    assert isinstance(run.optimizer.optimizer, InBackwardOptimizer)
    return run.optimizer.optimizer


# --------------------------------------------------------------------------------------------
# The mechanism, on the loop's tiny torch.nn model
# --------------------------------------------------------------------------------------------


def test_backward_updates_each_parameter_and_frees_its_gradient():
    import torch

    run = tiny_run(lever_config(warmup_steps=0))
    before = [p.detach().clone() for p in run.model.parameters()]
    batch = first_batch(run)
    run.accelerator.backward(run.model(**batch).loss)  # backward alone, no optimizer.step()
    for old, param in zip(before, run.model.parameters(), strict=True):
        assert not torch.equal(old, param)  # updated inside backward
        assert param.grad is None  # and its gradient freed at once
    assert len(inner(run).state) == 4  # every parameter has its own optimizer's state


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_updates_equal_a_normal_run_without_clipping(optim):
    """Same data, same schedule (warmup then linear decay), no clipping: same weights and the
    same optimizer state, in a normal optimizer's state-dict layout."""
    import torch

    normal = tiny_run(lever_config(optim=optim, optimizer_in_backward=False, max_grad_norm=0))
    train_steps(normal, 5)
    reset_accelerate()
    lever = tiny_run(lever_config(optim=optim))
    train_steps(lever, 5)

    assert lever.lr_scheduler.get_last_lr() == normal.lr_scheduler.get_last_lr()
    # On CPU both run the same single-tensor kernels on the same gradients: bit-identical.
    # (On CUDA, torch's multi-tensor foreach path may round differently: close, not equal.)
    for a, b in zip(normal.model.parameters(), lever.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert assert_identical(lever.optimizer.state_dict(), normal.optimizer.state_dict()) > 0


def test_the_shared_scheduler_sets_each_update_lr():
    run = tiny_run(lever_config(warmup_steps=3))
    lrs = []
    for optimizer in inner(run).optimizers.values():
        optimizer.register_step_pre_hook(lambda opt, *_: lrs.append(opt.param_groups[0]["lr"]))
    train_steps(run, 4)
    expected = [run.hyperparameters.lr * s / 3 for s in (0, 1, 2, 3)]  # warmup from 0
    assert lrs == [lr for lr in expected for _ in range(4)]


def test_state_dict_round_trip_continues_identically():
    import copy

    import torch

    run = tiny_run(lever_config())
    train_steps(run, 2)
    saved = copy.deepcopy(run.optimizer.state_dict())
    weights = copy.deepcopy(run.accelerator.unwrap_model(run.model).state_dict())
    reset_accelerate()

    restored = tiny_run(lever_config())
    restored.accelerator.unwrap_model(restored.model).load_state_dict(weights)
    restored.optimizer.load_state_dict(saved)
    assert_identical(restored.optimizer.state_dict(), saved)
    batch = first_batch(run)
    for r in (run, restored):
        r.model.eval()  # no dropout: the two see the same forward
        r.accelerator.backward(r.model(**batch).loss)
    for a, b in zip(run.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_other_groups():
    run = tiny_run(lever_config())
    saved = run.optimizer.state_dict()
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError, match="groups of sizes"):
        run.optimizer.load_state_dict(saved)


def test_the_ledger_counts_the_per_parameter_states():
    from effitrain.memory import ledger

    normal = tiny_run(lever_config(optimizer_in_backward=False, max_grad_norm=0))
    train_steps(normal, 1)
    reset_accelerate()
    lever = tiny_run(lever_config())
    train_steps(lever, 1)
    a, b = (
        ledger.optimizer_state_ledger(normal.optimizer),
        ledger.optimizer_state_ledger(lever.optimizer),
    )
    assert b.bytes == a.bytes > 0 and b.params_with_state == a.params_with_state == 4
    assert b.to_dict() == a.to_dict()


def test_nan_loss_says_the_update_already_happened():
    from effitrain.loop import StepGuard, train_step
    from effitrain.signals import StopRequest

    run = tiny_run(lever_config(), poison_call=1)
    guard = StepGuard(run.accelerator, StopRequest(), None, updates_in_backward=True)
    with pytest.raises(EffitrainError, match="already applied this step's update") as error:
        train_step(run, first_batch(run), TrainingProgress(), guard)
    assert "before the update" not in str(error.value)
    assert "--max-grad-norm" not in str(error.value)


def test_unhooked_parameters_are_refused():
    from tests.test_loop import TinyClassifier

    run = tiny_run(lever_config())
    with pytest.raises(EffitrainError, match="no update hook"):
        inner(run).check_hooked(TinyClassifier.build())
    inner(run).check_hooked(run.accelerator.unwrap_model(run.model))  # the prepared model is


# --------------------------------------------------------------------------------------------
# Options: the max-grad-norm default, and every refused combination
# --------------------------------------------------------------------------------------------


def test_max_grad_norm_default_is_1_and_0_with_the_lever():
    from effitrain.levers import max_grad_norm

    assert max_grad_norm(TrainConfig()) == 1.0
    assert max_grad_norm(TrainConfig(optimizer_in_backward=True)) == 0.0
    assert max_grad_norm(TrainConfig(max_grad_norm=0.5)) == 0.5
    config = checked_config(overrides={"optimizer_in_backward": True, "max_grad_norm": 0.0})
    assert max_grad_norm(config) == 0.0
    assert tiny_run(lever_config()).max_grad_norm == 0.0  # what the loop reads


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"max_grad_norm": 1.0}, ["--max-grad-norm 1 clips the global", "--max-grad-norm 0"]),
        ({"grad_accum": 2}, ["--grad-accum 2", "every micro-batch", "--grad-accum 1"]),
        ({"mixed_precision": "fp16"}, ["--mixed-precision fp16", "bf16 or no"]),
    ],
)
def test_impossible_combinations_are_refused(overrides, fragments):
    with pytest.raises(EffitrainError) as error:
        checked_config(overrides={"optimizer_in_backward": True, **overrides})
    message = str(error.value)
    assert "\n" not in message and "--optimizer-in-backward" in message
    for fragment in fragments:
        assert fragment in message


def test_refusal_through_the_cli_is_one_line(train_cli):
    proc = train_cli("train", "--optimizer-in-backward", "--max-grad-norm", "1")
    assert_clean_error(proc, "clips the global gradient norm")


@pytest.mark.parametrize(
    "state",
    [
        SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2, backend="gloo"),
        SimpleNamespace(distributed_type="MULTI_GPU", num_processes=2, backend="nccl"),
        SimpleNamespace(distributed_type="FSDP", num_processes=1, fsdp_plugin=None),
        SimpleNamespace(distributed_type="DEEPSPEED", num_processes=1, deepspeed_plugin=None),
    ],
)
def test_multi_process_and_sharded_launches_are_refused(state):
    import effitrain.levers as levers
    from effitrain.distributed import Launch

    launch = Launch.of(state)
    with pytest.raises(EffitrainError, match="before the processes average") as error:
        levers.check_launch(TrainConfig(optimizer_in_backward=True), launch)
    assert "\n" not in str(error.value)
    levers.check_launch(TrainConfig(), launch)  # without the lever: not this rule's business


def test_single_process_launch_is_accepted():
    import effitrain.levers as levers
    from effitrain.distributed import Launch

    state = SimpleNamespace(distributed_type="NO", num_processes=1)
    levers.check_launch(TrainConfig(optimizer_in_backward=True), Launch.of(state))


def test_resume_compares_max_grad_norm_as_used():
    from effitrain import checkpoint
    from effitrain.training import options_as_used  # what a resumed run compares the options with

    def config_differences(meta, config):
        return checkpoint.config_differences(meta, config, used=options_as_used)

    # A checkpoint written before the default became "unset" said 1.0 explicitly.
    old = {"config": {**TrainConfig().to_dict(), "max_grad_norm": 1.0}}
    assert config_differences(old, TrainConfig()) == []
    lever = {"config": TrainConfig(optimizer_in_backward=True).to_dict()}
    explicit = TrainConfig(optimizer_in_backward=True, max_grad_norm=0.0)
    assert config_differences(lever, explicit) == []
    assert config_differences(old, TrainConfig(max_grad_norm=0.5)) == ["max-grad-norm 1.0 -> 0.5"]


def test_help_shows_the_max_grad_norm_default(train_cli):
    text = " ".join(train_cli("train", "--help").stdout.split())
    assert "1.0; 0 with --optimizer-in-backward" in text
    assert "--optimizer-in-backward" in text


# --------------------------------------------------------------------------------------------
# Through the CLI on the tiny preset: banner, metrics, checkpoints, inspect-state, resume
# --------------------------------------------------------------------------------------------


def test_cli_run_checkpoint_and_inspect_state(train_cli, data, tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.json"
    args = train_args(data, out, "--max-steps", "3", "--save-every", "3", "--optimizer-in-backward")
    proc = train_cli(*args, "--metrics-json", str(metrics))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lever     optimizer step in backward" in proc.stdout
    result = json.loads(metrics.read_text())
    # Gradients at their peak: a few at a time, each freed as soon as its update ran.
    assert 0 < result["gradient_bytes"] < result["parameter_bytes"] / 5
    assert result["levers"] == ["optimizer-in-backward"]
    assert result["config"]["optimizer_in_backward"] is True
    assert result["optimizer_state"]["params_with_state"] == 40

    proc = train_cli("inspect-state", str(out / "checkpoint-3"), "--json", "--top", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    # Read like any checkpoint, and counted the same as the live optimizer.
    assert report["optimizer_state"] == result["optimizer_state"]
    assert report["optimizer"]["name"] == "adamw" and report["step"] == 3
    assert [g["params"] for g in report["param_groups"]] == [16, 24]


@pytest.mark.parametrize(
    "options", [(), pytest.param(("--gradient-checkpointing",), marks=pytest.mark.slow)]
)
def test_cli_lever_matches_the_normal_run(train_cli, data, tmp_path, options):
    """With dropout on, and with activations recomputed in backward (after later layers were
    already updated: each layer's recomputation uses only its own, not yet updated, weights)."""
    ends = {}
    for name, extra in (
        ("normal", ("--max-grad-norm", "0")),
        ("lever", ("--optimizer-in-backward",)),
    ):
        out = tmp_path / name
        args = train_args(data, out, "--max-steps", "4", "--save-every", "4", *options, *extra)
        proc = train_cli(*args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ends[name] = load_tensors(out / "checkpoint-4")
    # Weights, optimizer state (in the same layout) and scheduler: bit-identical on CPU.
    assert assert_identical(ends["lever"], ends["normal"]) > 40


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "adamw-8bit"])
def test_resume_mid_epoch_across_epoch_boundary_is_exact(train_cli, data, tmp_path, optim):
    options = ("--optimizer-in-backward", "--optim", optim, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


@pytest.mark.parametrize("main_process", [True, False])
def test_a_two_process_launch_is_refused_before_anything_is_built(
    train_cli, monkeypatch, main_process
):
    """Every process of a two-process launch (DDP over gloo, as ``accelerate launch`` on CPUs
    gives it) refuses with the one line before it builds or prints anything."""
    import effitrain.build as build

    state = SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2, backend="gloo")
    accelerator = SimpleNamespace(state=state, num_processes=2, is_main_process=main_process)
    monkeypatch.setattr(build, "build_accelerator", lambda config: accelerator)
    proc = train_cli("train", "--optimizer-in-backward", "--max-steps", "2")
    assert_clean_error(proc, "--optimizer-in-backward cannot run on DDP over 2 processes")
    assert proc.stdout == ""  # no banner: nothing was built or trained
