"""Lion (lion-pytorch), Lion8bit (bitsandbytes), CAME (pytorch-optimizer) and schedule-free AdamW
(schedulefree): state counted to the byte, exact resume, inspect-state, a run that learns, the
sharding rules, and schedule-free's train/eval modes around every evaluation and save."""

from __future__ import annotations

import json
import math

import pytest

from effitrain import optim
from effitrain.build import check_config
from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from tests.checkpoint_helpers import load_tensors, train_args
from tests.test_resume import assert_same_end, straight_and_resumed

OURS = ("lion", "lion-8bit", "came", "adamw-schedule-free")
BNB_BLOCK = 256  # bitsandbytes' blockwise quantization: one fp32 absmax per 256 values
QMAP_BYTES = 256 * 4  # one fp32 code map, shared by every 8-bit tensor


def small_model():
    import torch

    torch.manual_seed(0)
    # 128x64 = 8192 elements (8-bit, factored); 4x128 = 512 (< 4096: bnb keeps it fp32); biases.
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))


def stepped(name, steps=2):
    import torch

    model = small_model()
    optimizer = optim.build_optimizer(model, name, 1e-3, 0.01)
    optim.set_train_mode(optimizer, True)
    for _ in range(steps):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def expected_state(name, shapes):
    """(bytes, elements) of each optimizer's state, from its documented layout."""
    nbytes = elements = 0
    for shape in shapes:
        n = math.prod(shape)
        if name == "lion":  # exp_avg
            nbytes, elements = nbytes + 4 * n, elements + n
        elif name == "adamw-schedule-free":  # z, exp_avg_sq
            nbytes, elements = nbytes + 8 * n, elements + 2 * n
        elif name == "lion-8bit":  # state1: uint8 + absmax per block, or fp32; a Python int step
            if n >= 4096:
                blocks = -(-n // BNB_BLOCK)
                nbytes, elements = nbytes + n + 4 * blocks, elements + n + blocks
            else:
                nbytes, elements = nbytes + 4 * n, elements + n
            nbytes, elements = nbytes + 8, elements + 1
        elif name == "came":  # exp_avg; rows + cols twice (>= 2-D) or exp_avg_sq; RMS (0-d)
            if len(shape) >= 2:
                factors = 2 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
            else:
                factors = n
            nbytes, elements = nbytes + 4 * (n + factors + 1), elements + n + factors + 1
    if name == "lion-8bit":
        nbytes, elements = nbytes + QMAP_BYTES, elements + 256
    return nbytes, elements


STATE_KEYS = {
    "lion": {"exp_avg"},
    "lion-8bit": {"step", "__bnb_optimizer_quant_state__"},
    "came": {"exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"},
    "adamw-schedule-free": {"z", "exp_avg_sq"},
}


@pytest.mark.parametrize("name", OURS)
def test_ledger_counts_the_state_to_the_byte(name):
    from effitrain.memory.ledger import optimizer_state_ledger

    model, optimizer = stepped(name)
    shapes = [tuple(p.shape) for p in model.parameters()]
    ledger = optimizer_state_ledger(optimizer)
    assert (ledger.bytes, ledger.elements) == expected_state(name, shapes)
    # The layout the count assumes is the one the optimizer's own state_dict holds.
    entries = list(optimizer.state_dict()["state"].values())
    assert len(entries) == 4
    weight = entries[0]
    assert STATE_KEYS[name] <= set(weight)
    if name == "came":  # 1-D parameters keep a full second moment instead of the factors
        assert set(entries[2]) == {"exp_avg", "exp_avg_sq", "RMS"}
    if name == "lion-8bit":
        big, small = (e["__bnb_optimizer_quant_state__"] for e in entries[:2])
        assert str(big["state1"].dtype) == "torch.uint8" and "qmap1" in big
        assert str(small["state1"].dtype) == "torch.float32" and "qmap1" not in small


def test_bytes_per_param_is_measured():
    for name in OURS:
        assert optim.state_bytes_per_param(name) is not None  # benchmarks/optimizer_costs


@pytest.mark.parametrize(
    "name, module, extra",
    [
        ("lion", "lion_pytorch", "effitrain[lion]"),
        ("lion-8bit", "bitsandbytes", "effitrain[8bit]"),
        ("came", "pytorch_optimizer", "effitrain[came]"),
        ("adamw-schedule-free", "schedulefree", "effitrain[schedulefree]"),
    ],
)
def test_missing_package_is_one_install_line(monkeypatch, name, module, extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a)
    )
    with pytest.raises(EffitrainError) as error:
        optim.build_optimizer(small_model(), name, 1e-3, 0.0)
    assert f"needs the '{module}' package" in str(error.value) and extra in str(error.value)


def test_schedule_free_defaults_use_a_constant_schedule():
    spec = optim.OPTIMIZERS["adamw-schedule-free"]
    assert spec.scratch.scheduler == spec.fine_tune.scheduler == "constant"
    _, optimizer = stepped("adamw-schedule-free", steps=1)
    assert optimizer.param_groups[0]["warmup_steps"] == 0  # effitrain's schedule warms up


def test_set_train_mode_unwraps_and_ignores_optimizers_without_modes():
    import torch

    model, optimizer = stepped("adamw-schedule-free")

    class Wrapper:  # like accelerate's AcceleratedOptimizer
        def __init__(self, inner):
            self.optimizer = inner

    before = [p.detach().clone() for p in model.parameters()]
    optim.set_train_mode(Wrapper(optimizer), False)
    assert optimizer.param_groups[0]["train_mode"] is False
    assert not torch.equal(before[0], model[0].weight)  # the averaged weights are in place
    optim.set_train_mode(Wrapper(optimizer), False)  # twice: no second move
    assert optimizer.param_groups[0]["train_mode"] is False
    optim.set_train_mode(Wrapper(optimizer), True)
    assert torch.allclose(before[0], model[0].weight, atol=1e-6)
    optim.set_train_mode(torch.optim.AdamW(model.parameters()), False)  # no modes: nothing


# --------------------------------------------------------------------------------------------
# Through the CLI: resume, inspect-state, a run that learns
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", OURS)
def test_resume_mid_epoch_across_epoch_boundary_is_exact(train_cli, data, tmp_path, name):
    # Resume at step 4 of a 6-step epoch; the resumed part crosses epoch 1's evaluation (a
    # train -> eval -> train round trip for schedule-free) and ends at 8.
    options = ("--optim", name, "--max-steps", "8", "--save-every", "4")
    straight, resumed = straight_and_resumed(train_cli, data, tmp_path, 4, *options)
    assert_same_end(straight, resumed, 8)


def test_schedule_free_checkpoints_train_mode_and_saves_eval_mode_weights(
    train_cli, data, tmp_path
):
    """Checkpoints hold the training point y (train mode) with z; final/ holds the averaged
    weights x that eval() gives, x = lerp(y, z, 1 - 1/beta1): the ones that were evaluated."""
    import torch

    out = tmp_path / "out"
    options = ("--optim", "adamw-schedule-free", "--max-steps", "3", "--save-every", "3")
    proc = train_cli(*train_args(data, out, *options))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = load_tensors(out / "checkpoint-3")
    final = load_tensors(out / "final")["model"]
    opt = saved["optimizer.bin"]
    assert all(g["train_mode"] is True for g in opt["param_groups"])
    names = json.loads((out / "checkpoint-3" / "effitrain.json").read_text())["optimizer"][
        "param_names"
    ]
    beta1 = opt["param_groups"][0]["betas"][0]
    moved = 0
    for index, name in enumerate(names):
        y, z = saved["model"][name], opt["state"][index]["z"]
        x = y.lerp(z, 1 - 1 / beta1)
        assert torch.allclose(final[name], x, atol=1e-6, rtol=1e-5), name
        moved += not torch.allclose(final[name], y, atol=1e-6, rtol=1e-5)
    assert moved > len(names) // 2  # the train-mode weights were not what was saved


def test_schedule_free_modes_around_every_evaluation_and_save(monkeypatch, tmp_path):
    """train() before training, eval() for each evaluation (end of epoch and final) then train()
    again, and train mode for a checkpoint written on a signal."""
    import effitrain.loop as loop
    from effitrain.signals import StopRequest, TrainingStopped
    from tests.test_loop import fit_tiny, reset_accelerate, tiny_run

    calls = []
    real = loop.set_train_mode
    monkeypatch.setattr(loop, "set_train_mode", lambda o, t: (calls.append(t), real(o, t)))
    # 24 rows / batch 4 = 6 steps per epoch: evaluations after steps 6 and 8.
    config = TrainConfig(batch_size=4, max_steps=8, log_every=4, optim="adamw-schedule-free")
    run = tiny_run(config)
    inner = run.optimizer.optimizer
    fit_tiny(run)
    assert calls == [True, False, True, False, True]
    assert inner.param_groups[0]["train_mode"] is True
    assert inner.param_groups[0]["k"] == 8
    reset_accelerate()

    # A signal at step 3: the checkpoint is written in train mode, even if something left the
    # optimizer in eval mode before it.
    import effitrain.checkpoint as checkpoint

    on_stop = checkpoint.Checkpointer.on_stop

    def on_stop_in_eval_mode(self, progress):
        real(self.optimizer, False)
        return on_stop(self, progress)

    monkeypatch.setattr(checkpoint.Checkpointer, "on_stop", on_stop_in_eval_mode)
    stop = StopRequest()
    out = tmp_path / "stopped"
    config = TrainConfig(
        batch_size=4, max_steps=20, optim="adamw-schedule-free", output_dir=str(out)
    )
    run = tiny_run(config, on_call=lambda call: call == 3 and stop.request())
    with pytest.raises(TrainingStopped) as stopped:
        fit_tiny(run, stop)
    saved = load_tensors(stopped.value.checkpoint_path)["optimizer.bin"]
    assert saved["param_groups"][0]["train_mode"] is True
    assert run.optimizer.optimizer.param_groups[0]["train_mode"] is True
    reset_accelerate()


@pytest.mark.parametrize(
    "name, guess, second",
    [
        ("lion", "Lion (lion_pytorch.Lion)", "-"),
        ("lion-8bit", "one state: Lion8bit", "-"),
        ("came", "CAME (pytorch_optimizer.CAME)", "factored"),
        ("adamw-schedule-free", "schedulefree.AdamWScheduleFree", "full"),
    ],
)
def test_inspect_state_names_it_and_shows_shapes(train_cli, tmp_path, name, guess, second):
    import torch

    from tests.test_inspect_state import inspect_json

    model, optimizer = stepped(name)
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)  # a bare state dict: everything is inferred
    report = inspect_json(train_cli, path, "--top", "10")
    assert guess in report["optimizer"]["class"] and report["optimizer"]["inferred"]
    largest = report["largest"][0]
    assert largest["shape"] == [128, 64]
    assert largest["second_moment"].startswith(second)
    assert (
        report["optimizer_state"]["bytes"]
        == expected_state(name, [tuple(p.shape) for p in model.parameters()])[0]
    )


def test_came_confidence_average_is_short_enough_for_fine_tuning():
    # None of CAME's moments is bias-corrected: with its paper's beta3 (0.9999) the confidence
    # denominator is ~0.3 % of its settled value at step 30 and early updates are ~18x the lr
    # (MPNet's long reviews ended at chance). The registry passes 0.99 to every group.
    _, came = stepped("came")
    assert {group["betas"] for group in came.param_groups} == {(0.9, 0.999, 0.99)}
    # Its update's size at step t, relative to its settled size, is 1/sqrt(1 - beta3**t).
    assert 1 / math.sqrt(1 - 0.99**60) < 1.5 < 18 < 1 / math.sqrt(1 - 0.9999**30)


def test_came_is_told_apart_from_transformers_adafactor():
    from transformers.optimization import Adafactor

    from effitrain.inspection import infer_optimizer, infer_parameter

    model = small_model()
    hf = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    model(__import__("torch").randn(8, 64)).sum().backward()
    hf.step()
    assert infer_optimizer(hf.state_dict()) == "transformers.optimization.Adafactor"
    _, came = stepped("came")
    state = came.state_dict()
    assert infer_optimizer(state) == "CAME (pytorch_optimizer.CAME)"
    assert infer_parameter(state["state"][0]) == ([128, 64], "factored (128 + 64 values, twice)")
    only_1d = {"state": {0: state["state"][2]}, "param_groups": state["param_groups"]}
    assert infer_optimizer(only_1d) == "CAME (pytorch_optimizer.CAME)"


def test_schedule_free_refuses_optimizer_in_backward():
    with pytest.raises(EffitrainError) as error:
        check_config(
            TrainConfig(optim="adamw-schedule-free", optimizer_in_backward=True).validate()
        )
    message = str(error.value)
    assert "--optim adamw-schedule-free cannot combine with --optimizer-in-backward" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["lion", "lion-8bit", "came"])
def test_elementwise_entries_accept_optimizer_in_backward(name):
    check_config(TrainConfig(optim=name, optimizer_in_backward=True).validate())
