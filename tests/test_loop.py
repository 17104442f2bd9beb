"""The loop's seams on a tiny ``torch.nn`` model, in milliseconds: the step function, the
progress counters, the checkpoint policy, and faults injected through them (a NaN loss, a
non-finite gradient, a signal in the middle of a step), up to an exact resume."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from effitrain.checkpoint import CheckpointPolicy
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.progress import Stopwatch, TrainingProgress

FEATURES = 6
ROWS = 24  # at batch size 4: 6 micro-batches per epoch


class TinyClassifier:
    """Built lazily (torch is imported inside the tests): a linear classifier whose forward
    returns ``.loss`` and ``.logits`` like a Hugging Face model, and can be told to fail."""

    @staticmethod
    def build(poison_call: int | None = None, on_call=None):
        import torch

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.hidden = torch.nn.Linear(FEATURES, 8)
                self.classifier = torch.nn.Linear(8, 2)
                self.dropout = torch.nn.Dropout(0.1)  # draws randomness: resume must restore it
                self.calls = 0

            def forward(self, features, labels):
                logits = self.classifier(self.dropout(torch.relu(self.hidden(features))))
                loss = torch.nn.functional.cross_entropy(logits, labels)
                if self.training:
                    self.calls += 1
                    if self.calls == poison_call:
                        loss = loss * float("nan")
                    if on_call is not None:
                        on_call(self.calls)
                return SimpleNamespace(loss=loss, logits=logits)

        return Model()


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate():
    reset_accelerate()
    yield
    reset_accelerate()


def tiny_run(config: TrainConfig | None = None, **model_options):
    """A prepared :class:`effitrain.run.Run` around the tiny model and random data, put together
    by the builder's own :func:`effitrain.build.assemble` (optimizer, scheduler, the levers'
    contexts, ``accelerator.prepare``), as :func:`effitrain.build.build_run` does.

    The model is built after seeding, so every run starts from the same weights.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader

    from effitrain import build
    from effitrain.distributed import Launch
    from effitrain.run import Plan
    from effitrain.tasks import get_task
    from effitrain.tracking import Trackers

    config = config or TrainConfig(batch_size=4, max_steps=6, log_every=1)
    build.check_config(config)
    accelerator = Accelerator(
        gradient_accumulation_plugin=build.accumulation_plugin(config.grad_accum),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(config.seed)
    launch = Launch.of(accelerator.state)
    build.check_launch(config, launch)
    data = torch.Generator().manual_seed(0)
    features = torch.randn(ROWS, FEATURES, generator=data)
    labels = (features[:, 0] > 0).long()
    rows = [{"features": f, "labels": y} for f, y in zip(features, labels, strict=True)]
    train_loader = DataLoader(
        rows,
        batch_size=config.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    eval_loader = DataLoader(rows[:8], batch_size=8)
    train_loader, eval_loader = accelerator.prepare(train_loader, eval_loader)
    model = TinyClassifier.build(**model_options)
    task = get_task("sequence-classification")
    warmup_ratio = build.resolve_hyperparameters(config, task).warmup_ratio
    return build.assemble(
        config=config,
        accelerator=accelerator,
        launch=launch,
        task=task,
        data=SimpleNamespace(num_labels=2),
        tokenizer=None,
        model=model,
        loss=build.build_loss(config, task, model, launch, accelerator.device),
        train_loader=train_loader,
        eval_loader=eval_loader,
        plan=Plan.from_config(config, len(train_loader), warmup_ratio),
        trackers=Trackers(accelerator, config),
    )


def first_batch(run):
    return next(iter(run.train_loader))


def guard_for(run, stop=None):
    from effitrain.loop import StepGuard
    from effitrain.signals import StopRequest

    return StepGuard(run.accelerator, stop or StopRequest(), run.config.output_dir)


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------
# The step function
# --------------------------------------------------------------------------------------------


def test_train_step_is_accelerates_example_loop():
    """One step equals forward, backward, clip, optimizer.step, scheduler.step, zero_grad."""
    import copy

    import torch

    from effitrain.loop import train_step

    run = tiny_run(TrainConfig(batch_size=4, max_steps=6, max_grad_norm=0.5, warmup_steps=0))
    run.model.eval()  # no dropout, so the reference below sees the same forward
    reference = copy.deepcopy(run.accelerator.unwrap_model(run.model))
    reference_optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=run.hyperparameters.lr,
    )
    batch = first_batch(run)
    progress = TrainingProgress()

    outcome = train_step(run, batch, progress, guard_for(run))
    loss = reference(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    reference_optimizer.step()

    assert outcome.stepped and not outcome.stop
    for mine, theirs in zip(run.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert mine.grad is None  # zero_grad(set_to_none=True)
    assert run.lr_scheduler.scheduler.last_epoch == 1
    assert progress.gradient_bytes == sum(p.numel() * 4 for p in reference.parameters())
    assert progress.flush_window() == (pytest.approx(loss.item()), 1.0, 4.0)


def test_train_step_accumulates_before_stepping():
    import torch

    from effitrain.loop import train_step

    run = tiny_run(TrainConfig(batch_size=4, max_steps=3, grad_accum=2, warmup_steps=0))
    before = parameters(run.model)
    batches = iter(run.train_loader)
    progress = TrainingProgress()
    guard = guard_for(run)
    first = train_step(run, next(batches), progress, guard)
    assert not first.stepped
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))
    assert all(p.grad is not None for p in run.model.parameters())  # kept for the next one
    second = train_step(run, next(batches), progress, guard)
    assert second.stepped
    assert not all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))
    assert progress.flush_window()[1:] == (2.0, 8.0)


def test_nan_loss_raises_before_the_update():
    import torch

    from effitrain.loop import train_step

    run = tiny_run(poison_call=1)
    before = parameters(run.model)
    with pytest.raises(EffitrainError, match="non-finite loss nan at step 1 .*before the update"):
        train_step(run, first_batch(run), TrainingProgress(), guard_for(run))
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))
    assert not run.optimizer.state  # the optimizer never stepped


def test_nan_in_an_earlier_micro_batch_is_caught_at_the_step():
    from effitrain.loop import train_step

    # Without clipping, no gradient norm is computed: the window's loss sum tells.
    run = tiny_run(
        TrainConfig(batch_size=4, max_steps=3, grad_accum=2, max_grad_norm=0),
        poison_call=1,
    )
    batches, progress, guard = iter(run.train_loader), TrainingProgress(), guard_for(run)
    train_step(run, next(batches), progress, guard)  # NaN, but no update is due yet
    with pytest.raises(EffitrainError, match="earlier micro-batch"):
        train_step(run, next(batches), progress, guard)


def test_nonfinite_gradient_with_a_finite_loss():
    from effitrain.loop import train_step

    run = tiny_run()
    run.accelerator.unwrap_model(run.model).classifier.weight.register_hook(
        lambda grad: grad * float("inf")
    )
    with pytest.raises(EffitrainError, match="non-finite gradient norm .* at step 1"):
        train_step(run, first_batch(run), TrainingProgress(), guard_for(run))


def test_signal_in_the_middle_of_a_step_finishes_the_step():
    import torch

    from effitrain.loop import train_step
    from effitrain.signals import stop_on_signals

    run = tiny_run(
        TrainConfig(batch_size=4, max_steps=6, warmup_steps=0),
        on_call=lambda call: os.kill(os.getpid(), signal.SIGTERM),
    )
    before = parameters(run.model)
    with stop_on_signals() as stop:
        outcome = train_step(run, first_batch(run), TrainingProgress(), guard_for(run, stop))
    assert outcome == (True, True)
    assert stop.signal_name == "SIGTERM" and stop.exit_code == 143
    assert not all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))


def backward_calls() -> list[tuple[str, str, str]]:
    """Every ``<something>.backward(...)`` call in effitrain's source: (file relative to the
    package's parent, enclosing function, the called expression)."""
    import ast
    from pathlib import Path

    import effitrain

    def calls(node: ast.AST, function: str):
        """(enclosing function, call) for each ``.backward(...)`` under ``node``."""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "backward"
        ):
            yield function, node
        for child in ast.iter_child_nodes(node):
            yield from calls(child, function)

    package = Path(effitrain.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(package.parent).as_posix()
        for function, call in calls(ast.parse(source, filename=str(path)), "<module>"):
            found.append((where, function, ast.get_source_segment(source, call.func)))
    return found


def test_backward_is_called_in_one_place():
    """A run's and an estimate's steps both go through ``train_step``: the only backward call
    in effitrain is Accelerate's, there."""
    assert backward_calls() == [("effitrain/loop.py", "train_step", "accelerator.backward")]


# --------------------------------------------------------------------------------------------
# Progress counters and the stopwatch
# --------------------------------------------------------------------------------------------


def test_progress_state_dict_round_trip():
    import torch

    progress = TrainingProgress()
    for loss in (0.5, 0.25):
        progress.add_micro_batch(torch.tensor(loss), 4)
        progress.step_done()
    progress.flush_window()
    progress.add_micro_batch(torch.tensor(1.0), 2)
    progress.measure_gradients(torch.nn.Linear(3, 2))  # no grads yet: 0, measured later
    progress.record_evaluation({"accuracy": 0.5}, epoch_complete=True)
    progress.step_memory = {"peak_tensor_bytes": 10, "at_peak": {"activations": 6}}
    progress.loss_history.append({"step": 2, "loss": 0.5})
    state = progress.state_dict()
    assert state == {
        "global_step": 2,
        "epoch": 1,
        "step_in_epoch": 0,
        "total_loss": 0.75,
        "total_batches": 2.0,
        "total_samples": 8.0,
        "total_tokens": 0.0,
        "eval_history": [{"accuracy": 0.5, "epoch": 1, "step": 2}],
        "gradient_bytes": 0,
        "step_memory": {"peak_tensor_bytes": 10, "at_peak": {"activations": 6}},
        "generation_memory": {},
        "loss_history": [{"step": 2, "loss": 0.5}],
        "window": [1.0, 1.0, 2.0, 0.0],
    }
    restored = TrainingProgress()
    restored.load_state_dict(state)
    # Measurements are the saving run's, not restored: a resumed run measures its own.
    assert restored.state_dict() == {**state, "step_memory": {}}
    restored.step_memory = progress.step_memory
    assert restored == progress
    other_rank = TrainingProgress(is_main_process=False)
    other_rank.load_state_dict(state)
    assert other_rank.state_dict()["window"] == [0.0, 0.0, 0.0, 0.0]  # summed into the main's once


def test_progress_refuses_a_checkpoint_without_every_field():
    state = TrainingProgress().state_dict()
    del state["total_tokens"]
    with pytest.raises(EffitrainError, match="lacks total_tokens: it was written by another"):
        TrainingProgress().load_state_dict(state)


def test_evaluation_mid_epoch_keeps_the_pointer():
    progress = TrainingProgress()
    progress.step_done()
    progress.record_evaluation({"loss": 1.0}, epoch_complete=False)
    assert (progress.epoch, progress.step_in_epoch) == (0, 1)
    assert progress.eval_history == [{"loss": 1.0, "epoch": 1, "step": 1}]


def test_stopwatch_leaves_pauses_out(monkeypatch):
    import effitrain.progress as module

    now = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: now[0])
    timer = Stopwatch()
    now[0] += 2.0
    timer.lap()
    with timer.paused():
        now[0] += 50.0  # an evaluation
    now[0] += 1.0
    timer.lap()
    assert timer.step_seconds == [2.0, 1.0]
    assert timer.window_seconds() == 3.0 and timer.recent_mean(1) == 1.0
    assert timer.train_seconds == 3.0 and timer.median_step_seconds == 1.0


def test_stopwatch_median_leaves_out_the_first_and_the_measured_step(monkeypatch):
    import effitrain.progress as module

    now = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: now[0])
    timer = Stopwatch()
    for seconds, measured in ((5.0, False), (9.0, True), (1.0, False), (2.0, False)):
        now[0] += seconds
        timer.lap()
        if measured:
            timer.leave_out_last()
    assert timer.median_step_seconds == 1.5 and timer.train_seconds == 17.0


# --------------------------------------------------------------------------------------------
# The checkpoint policy
# --------------------------------------------------------------------------------------------


def policy(**options) -> CheckpointPolicy:
    config = TrainConfig(output_dir="out", **options)
    return CheckpointPolicy.from_config(config, total_steps=10, steps_per_epoch=4)


@pytest.mark.parametrize(
    ("options", "after_steps", "after_evaluations"),
    [
        # every 2 steps; 4 and 8 end an epoch and 10 the run: saved after their evaluation.
        ({"save_every": 2}, [2, 6], [4, 8, 10]),
        ({"save_strategy": "epoch"}, [], [4, 8, 10]),
        ({"save_strategy": "epoch", "save_every": 3}, [3, 6, 9], [4, 8, 10]),
        ({}, [], []),  # no periodic checkpoints: only a signal saves
    ],
)
def test_policy_decides_when_to_save(options, after_steps, after_evaluations):
    rule = policy(**options)
    saved = [step for step in range(1, 11) if rule.save_after_step(step, (step - 1) % 4 + 1)]
    assert saved == after_steps
    boundaries = (4, 8, 10)  # evaluations happen at epoch ends and at the end of the run
    assert [step for step in boundaries if rule.save_after_evaluation(step)] == after_evaluations
    assert rule.on_stop


def test_policy_without_an_output_dir_never_saves():
    rule = CheckpointPolicy.from_config(TrainConfig(), total_steps=10, steps_per_epoch=4)
    assert not rule.periodic and not rule.on_stop
    assert not rule.save_after_evaluation(10)


# --------------------------------------------------------------------------------------------
# fit(): faults through the seams, with real checkpoints of the tiny model
# --------------------------------------------------------------------------------------------


def recording_reporter():
    from io import StringIO

    from rich.console import Console

    from effitrain.report.live import Reporter

    stream = StringIO()
    return Reporter(console=Console(file=stream, width=200, highlight=False)), stream


def fit_tiny(run, stop=None):
    """``train()``'s middle on a tiny run: resume if asked, then fit."""
    from effitrain.loop import fit
    from effitrain.signals import StopRequest
    from effitrain.training import make_checkpointer, resume

    reporter, stream = recording_reporter()
    progress = TrainingProgress.for_accelerator(run.accelerator)
    checkpointer = make_checkpointer(run)
    if run.config.resume:
        resume(run, progress, checkpointer, reporter)
    try:
        fit(run, progress, checkpointer, reporter, stop or StopRequest())
    finally:
        stream.seek(0)
    return progress, stream.read()


def test_nan_at_step_5_keeps_the_last_good_checkpoint(tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "out"
    config = TrainConfig(batch_size=4, max_steps=8, save_every=2, output_dir=str(out))
    run = tiny_run(config, poison_call=5)
    steps = []
    run.optimizer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    with pytest.raises(EffitrainError) as error:
        fit_tiny(run)
    assert "non-finite loss nan at step 5" in str(error.value)
    assert f"last good checkpoint: {out / 'checkpoint-4'}" in str(error.value)
    assert len(steps) == 4  # the bad update never ran
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    weights = load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_signal_without_output_dir_saves_nothing():
    from effitrain.signals import StopRequest, TrainingStopped

    stop = StopRequest()
    run = tiny_run(
        TrainConfig(batch_size=4, max_steps=20),
        on_call=lambda call: call == 3 and stop.request(signal.SIGINT),
    )
    with pytest.raises(TrainingStopped) as stopped:
        fit_tiny(run, stop)
    assert stopped.value.exit_code == 130 and stopped.value.checkpoint_path is None


def test_stop_at_an_epoch_end_then_resume_is_exact(tmp_path):
    """A stop at the last step of an epoch (with grad accumulation) saves before that epoch's
    evaluation; the resumed run evaluates it, continues, and ends bit-identical."""
    import torch

    from effitrain.signals import StopRequest, TrainingStopped

    def config(out, **extra):
        return TrainConfig(
            batch_size=4, grad_accum=2, max_steps=7, log_every=2, output_dir=str(out), **extra
        )

    straight_progress, _ = fit_tiny(straight := tiny_run(config(tmp_path / "straight")))

    stop = StopRequest()
    # 3 optimizer steps per epoch, 2 micro-batches each: micro-batch 6 ends epoch 1.
    with pytest.raises(TrainingStopped) as stopped:
        fit_tiny(
            tiny_run(config(tmp_path / "stopped"), on_call=lambda c: c == 6 and stop.request()),
            stop,
        )
    assert stopped.value.checkpoint_path == tmp_path / "stopped" / "checkpoint-3"
    reset_accelerate()

    resumed = tiny_run(config(tmp_path / "stopped", resume="latest"))
    progress, text = fit_tiny(resumed)
    assert "eval (epoch 1)" in text  # evaluated after the resume, not before the stop
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert progress.state_dict() == straight_progress.state_dict()


@pytest.mark.parametrize(
    ("steps_per_epoch", "total_steps", "measured"),
    # (2, 2, 1): the last step ends the epoch, but the one before is the first, whose backward
    # runs before the optimizer has created its state.
    [(5, 12, 11), (5, 10, 8), (1, 3, 2), (5, 1, 0), (3, 2, 1), (2, 2, 1), (2, 4, 2)],
)
def test_the_measured_step_is_late_and_never_an_epochs_short_remainder(
    steps_per_epoch, total_steps, measured
):
    from effitrain.run import Plan

    plan = Plan(steps_per_epoch, total_steps, -(-total_steps // steps_per_epoch), 0)
    assert plan.measured_step == measured


@pytest.mark.parametrize(
    ("steps_per_epoch", "total_steps", "measured"),
    # Every second step generates (0, 2, 4, ...). (6, 12, 8): the last two steps train on the
    # epoch's short remainder's completions, so the cycle before, from its generating step.
    # (4, 2, 1): no step after the first generates: the last, its generation not measured.
    [(10, 4, 2), (10, 5, 4), (10, 7, 6), (6, 12, 8), (4, 2, 1), (4, 3, 2)],
)
def test_under_num_iterations_the_measured_step_is_one_that_generates(
    steps_per_epoch, total_steps, measured
):
    """--num-iterations 2: the step measured is one that generates, so that both of its phases
    are measured (a reusing step has no generation phase to measure)."""
    from effitrain.run import Plan

    plan = Plan(steps_per_epoch, total_steps, -(-total_steps // steps_per_epoch), 0, 2)
    assert plan.measured_step == measured


@pytest.mark.parametrize("max_steps", [1, 6])
def test_the_planned_step_is_the_measured_one(monkeypatch, max_steps):
    """Tracking an early step leaves the heap laid out so that later steps grow it (see
    ``measure_now``): the breakdown is of one of the run's last two steps, the only one
    tracked."""
    from effitrain import loop
    from effitrain.memory.step import available

    if not available():
        pytest.skip("needs torch's MemTracker")
    measured_at = []
    decide = loop.measure_now

    def recording(run, progress, probe):
        if decide(run, progress, probe):
            measured_at.append(progress.global_step)
            return True
        return False

    monkeypatch.setattr(loop, "measure_now", recording)
    run = tiny_run(TrainConfig(batch_size=4, max_steps=max_steps, log_every=1))
    progress, _ = fit_tiny(run)
    assert measured_at == [run.plan.measured_step]
    assert run.plan.measured_step >= max_steps - 2
    assert progress.step_memory["kind_peaks"]["activations"] > 0
    if max_steps > 1:  # the state exists from the first step on, at the step's peak too
        assert progress.step_memory["at_peak"]["optimizer_state"] > 0
