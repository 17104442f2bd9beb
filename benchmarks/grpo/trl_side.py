"""TRL's side: GRPO with ``trl.GRPOTrainer`` on the same model folder, prompts, reward
(effitrain's built-in ``letter_share``, passed as a TRL reward function) and settings as the
effitrain rows, written to --metrics-json: each optimizer step's mean reward (TRL's logged
``reward``, one log line a step), its lr, and the median seconds per step (between the ends of
consecutive steps, the first left out, as effitrain's median). Peak RSS is the kernel's (the
benchmark reads it with ``wait4``, as for the effitrain rows).

    python -m benchmarks.grpo.trl_side --model DIR --train-file prompts.jsonl --max-steps 300 \\
        --lr 1e-3 --warmup-steps 18 --seed 0 --metrics-json trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from effitrain.tasks.grpo_rewards import letter_share

if TYPE_CHECKING:
    from trl import GRPOTrainer


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo.trl_side")
    for name in ("--model", "--train-file", "--metrics-json"):
        parser.add_argument(name, required=True)
    for name in ("--max-steps", "--warmup-steps", "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="completions a step")
    parser.add_argument("--num-generations", type=int, required=True)
    parser.add_argument("--max-completion-length", type=int, required=True)
    return parser.parse_args(argv)


def check_decay(trainer: GRPOTrainer) -> None:
    """The Trainer decays the weights effitrain decays (every >= 2-D one; biases and norms not):
    a difference would be a setting that differs."""
    decayed = {
        id(p)
        for group in trainer.optimizer.param_groups
        if group["weight_decay"]
        for p in group["params"]
    }
    expected = {id(p) for p in trainer.model.parameters() if p.requires_grad and p.ndim >= 2}
    if decayed != expected:
        raise SystemExit(
            "error: TRL's weight-decay groups differ from effitrain's (>= 2-D weights)"
        )


def config_kwargs(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """``GRPOConfig``'s arguments: every setting the comparison depends on given, none left to
    a default (tests/test_benchmarks_grpo.py checks them against effitrain's options)."""
    import torch

    return {
        "output_dir": output_dir,
        "max_steps": args.max_steps,
        "per_device_train_batch_size": args.batch_size,
        "gradient_accumulation_steps": 1,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.lr,
        "lr_scheduler_type": "linear",
        "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay,
        "optim": "adamw_torch",
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "epsilon": 0.2,
        "epsilon_high": None,  # the same as epsilon
        "num_iterations": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "generation_kwargs": {"use_cache": True},  # the saved config has it off (for training)
        "bf16": False,  # fp32 weights and compute, as effitrain's
        "gradient_checkpointing": False,  # GRPOConfig's default is on; effitrain's is off
        "logging_steps": 1,  # one log line a step: each step's reward
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": [],
        "seed": args.seed,
        "disable_tqdm": True,
        "log_level": "error",
        "use_cpu": not torch.cuda.is_available(),
    }


def main(argv: list[str]) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.vs_trainer.trainer import StepTimer

    args = parse(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    data = load_dataset("json", data_files={"train": args.train_file})["train"]
    times = StepTimer()  # the time between step ends, as effitrain's stopwatch
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
        config = GRPOConfig(**config_kwargs(args, output_dir))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[letter_share],
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[times],
        )
        trainer.create_optimizer()
        check_decay(trainer)
        output = trainer.train()
        logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = {
        "side": "trl",
        "seconds_per_step": statistics.median(times.step_seconds[1:] or times.step_seconds),
        "reward_history": [entry["reward"] for entry in logs],
        "lr_history": [entry["learning_rate"] for entry in logs],
        "mean_length_history": [entry["completions/mean_length"] for entry in logs],
        "global_steps": trainer.state.global_step,
        "train_loss": output.training_loss,
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.metrics_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
