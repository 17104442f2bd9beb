"""benchmarks/grpo builds what it compares: both sides get the same settings (effitrain's
options as ``effitrain train`` parses them, TRL's ``GRPOConfig`` as TRL builds it), TRL's
recorded lrs are effitrain's schedule, and the goal is computed as the issue states it. Nothing
here trains."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import common
from benchmarks.grpo import run, trl_side


def _options(tmp_path, steps=300, seed=1):
    args = argparse.Namespace(steps=steps, work_dir=tmp_path)
    data = (tmp_path / "train.jsonl", tmp_path / "validation.jsonl")
    return run.side_options(args, tmp_path / "model", data, seed)


def test_both_sides_get_the_same_settings(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from effitrain.cli.compare import train_config
    from effitrain.tasks import resolve_task

    effitrain_options, trl_options = _options(tmp_path)
    ours = train_config(effitrain_options)
    resolve_task(ours).check_options(ours)  # --task grpo takes every option given
    args = trl_side.parse([*trl_options, "--metrics-json", str(tmp_path / "m.json")])
    theirs = GRPOConfig(**trl_side.config_kwargs(args, str(tmp_path / "trl")))
    pairs = {
        "model": (ours.model, args.model),
        "train file": (ours.train_file, args.train_file),
        "steps": (ours.max_steps, theirs.max_steps),
        "seed": (ours.seed, theirs.seed),
        "completions a step": (
            ours.batch_size * ours.grad_accum,
            theirs.per_device_train_batch_size * theirs.gradient_accumulation_steps,
        ),  # fmt: skip
        "G": (ours.num_generations, theirs.num_generations),
        "completion tokens": (ours.max_completion_length, theirs.max_completion_length),
        "optimizer": (ours.optim, {"adamw_torch": "adamw"}.get(_value(theirs.optim))),  # torch's
        "lr": (ours.lr, theirs.learning_rate),
        "schedule": (ours.scheduler, _value(theirs.lr_scheduler_type)),
        "warmup": (ours.warmup_steps, theirs.warmup_steps),
        "weight decay": (ours.weight_decay, theirs.weight_decay),
        "gradient clipping": (ours.max_grad_norm, theirs.max_grad_norm),
        "beta": (ours.beta, theirs.beta),
        "loss": (ours.grpo_loss, theirs.loss_type),
        "scale rewards": (ours.scale_rewards, theirs.scale_rewards),
        "epsilon": (ours.epsilon, theirs.epsilon),
        "epsilon high": (ours.epsilon_high or ours.epsilon, theirs.epsilon_high or theirs.epsilon),
        "temperature": (ours.temperature, theirs.temperature),
        "top-p": (ours.top_p, theirs.top_p),
        "fp32": (ours.mixed_precision, "no" if not theirs.bf16 and not theirs.fp16 else "yes"),
        "checkpointing": (ours.gradient_checkpointing, theirs.gradient_checkpointing),
    }
    differ = {name: pair for name, pair in pairs.items() if str(pair[0]) != str(pair[1])}
    assert not differ
    assert theirs.num_iterations == 1 and theirs.top_k == 0  # effitrain's: one, top-k off
    assert ours.warmup_steps == math.ceil(300 * run.SETTINGS["warmup_ratio"]) == 18


def _value(choice):
    """A TrainingArguments enum's value (``OptimizerNames.ADAMW_TORCH`` -> ``adamw_torch``)."""
    return getattr(choice, "value", choice)


def test_trl_recorded_the_schedule_effitrain_builds():
    """Every recorded TRL run logged, step by step, the lr effitrain's scheduler gives its own
    run (warmup, then linear to 0)."""
    import torch

    from effitrain.optim.schedule import build_scheduler

    data = common.load_results(run.TOPIC.results, run.TOPIC)
    rows = [(r, row) for r in data["runs"] for row in r["rows"] if row["side"] == "trl"]
    assert rows, "no TRL run recorded"
    for recorded, row in rows:
        steps, warmup = recorded["settings"]["steps"], recorded["settings"]["warmup_steps"]
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=run.SETTINGS["lr"])
        scheduler = build_scheduler(optimizer, "linear", steps, warmup)
        ours = []
        for _ in range(steps):
            ours.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert row["lr_history"] == pytest.approx(ours, abs=1e-12), row["row"]


def test_the_goal_per_seed_and_over_the_seeds():
    rising = [0.1] * 10 + [0.5] * 10  # rises 0.4
    slower = [0.1] * 10 + [0.38] * 10  # rises 0.28: 70 % of it, ends 0.12 below
    assert run.goal([rising], [rising]) == {"share": 1.0, "gap": 0.0, "met": True}
    behind = run.goal([slower], [rising])
    assert behind["share"] == pytest.approx(0.7) and behind["gap"] == pytest.approx(-0.12)
    assert not behind["met"]  # it rose enough, but ends too far below
    both = run.goal([rising, slower], [rising, rising])
    assert both["share"] == pytest.approx(0.85) and both["gap"] == pytest.approx(-0.06)


def test_a_run_renders_its_goal_and_curves():
    def row(side, seed, history):
        return {"row": f"{side}-seed{seed}", "side": side, "seed": seed,
                "reward_history": history, "seconds_per_step": 0.2, "peak_rss_bytes": 2**29,
                "wall_seconds": 60.0}  # fmt: skip

    history = [0.1] * 10 + [0.6] * 10
    rows = [row("effitrain", 0, history), row("trl", 0, history)]
    settings = {"model": "m", "prompts": "p", "reward": "r", "num_generations": 8,
                "max_completion_length": 16, "batch_size": 16, "lr": 1e-3, "warmup_steps": 2,
                "weight_decay": 0.01, "steps": 20, "torch_threads": 1}  # fmt: skip
    text = run.render({"rows": rows, "settings": settings})
    assert "| seed 0 | 100% | +0.000 | met |" in text
    assert (
        "| effitrain `--task grpo`, seed 0 | 0.100 | 0.600 | +0.500 | 18 | 512.0 MiB (1.00×)"
        in text
    )
    assert run.steps_to(history, 0.7) is None
