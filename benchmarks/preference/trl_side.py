"""TRL's side: DPO with ``trl.DPOTrainer`` on the same model folder, pairs and batch as the
effitrain rows, measured the way effitrain measures itself, written to --metrics-json.

One training step late in the run (the last, so the optimizer state exists, as effitrain's
``Plan.measured_step``) runs under effitrain's own probe
(:class:`effitrain.memory.step.StepMemoryProbe`: torch's ``MemTracker``), started by a
``TrainerCallback`` at ``on_step_begin`` and stopped at ``on_optimizer_step``, right after
``optimizer.step()`` as effitrain's loop stops it. Tracked as tensors that exist before the step:
the policy, the reference model (TRL's copy, when it keeps one) and the optimizer with its state.
The policy's and the reference's weights are both filed by the tracker as parameters; the
reference's bytes are reported apart (``reference_bytes``) so the two can be told apart. Peak RSS
is the kernel's (the benchmark reads it with ``wait4``, as for every effitrain row).

    python -m benchmarks.preference.trl_side --model DIR --train-file pairs.jsonl \\
        --max-length 1024 --max-steps 3 --reference copy --metrics-json trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preference.trl_side")
    for name in ("--model", "--train-file", "--metrics-json"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument(
        "--reference", choices=["copy", "precompute"], default="copy",
        help="copy: TRL's default (a second model); precompute: precompute_ref_log_probs=True",
    )  # fmt: skip
    parser.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="TRL's own default (DPOConfig.gradient_checkpointing=True); off unless given",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def tensor_bytes(module: torch.nn.Module | None, buffers: bool = True) -> int:
    """A model's parameter (and buffer) bytes, each storage once."""
    if module is None:
        return 0
    storages = {}
    for tensor in [*module.parameters(), *(module.buffers() if buffers else ())]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class MeasureStep(TrainerCallback):
    """effitrain's probe around one optimizer step, and the time between step ends."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer: DPOTrainer | None = None
        self.probe = None
        self.memory: dict | None = None
        self.step_seconds: list[float] = []
        self.last = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.trainer is None:
            return
        from effitrain.memory.step import StepMemoryProbe

        trainer = self.trainer
        # The tracker is given the policy and TRL's reference copy (None with a precomputed
        # reference) as one module, and the optimizer with its state.
        models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        self.probe = StepMemoryProbe(torch.nn.ModuleList(models), trainer.optimizer, args.device)
        self.probe.start()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.probe is not None and self.probe.running:
            measured = self.probe.stop()
            self.memory = measured.to_dict() if measured else None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self.last)
        self.last = now


def main(argv: list[str]) -> None:
    args = parse(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    data = load_dataset("json", data_files={"train": args.train_file})["train"]
    measure = MeasureStep(step=args.max_steps - 1)
    with tempfile.TemporaryDirectory(prefix="trl-dpo-") as output_dir:
        config = DPOConfig(
            output_dir=output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            beta=args.beta,
            max_length=args.max_length,
            optim="adamw_torch",
            bf16=False,  # fp32 weights and compute, as the effitrain rows it is compared with
            gradient_checkpointing=args.gradient_checkpointing,
            precompute_ref_log_probs=args.reference == "precompute",
            save_strategy="no",
            eval_strategy="no",
            logging_steps=1,
            report_to=[],
            seed=args.seed,
            disable_tqdm=True,
            log_level="error",
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[measure],
        )
        measure.trainer = trainer
        output = trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        lengths = [
            len(row["prompt_ids"]) + len(row[answer])
            for row in trainer.train_dataset
            for answer in ("chosen_ids", "rejected_ids")
        ]
    memory = measure.memory or {}
    result = {
        "side": "trl",
        "seconds_per_step": statistics.median(measure.step_seconds[1:] or measure.step_seconds),
        "peak_tensor_bytes": memory.get("peak_tensor_bytes"),
        "step_memory": memory,
        "reference_bytes": tensor_bytes(trainer.ref_model),
        "reference_parameter_bytes": tensor_bytes(trainer.ref_model, buffers=False),
        "policy_bytes": tensor_bytes(trainer.model),
        "optimizer_state_bytes": _optimizer_state_bytes(trainer.optimizer),
        "train_loss": output.training_loss,
        "loss_history": [{"step": e["step"], "loss": e["loss"]} for e in logs],
        "global_steps": trainer.state.global_step,
        "measured_step": measure.step,
        "sequence_tokens": {"min": min(lengths), "max": min(max(lengths), args.max_length)},
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.metrics_json).write_text(json.dumps(result, indent=1))


def _optimizer_state_bytes(optimizer) -> int:
    from effitrain import optimizer_memory

    return optimizer_memory(optimizer).bytes


if __name__ == "__main__":
    main(sys.argv[1:])
