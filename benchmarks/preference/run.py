"""Preference tuning (issue 39): what the reference model costs each way, against TRL's
``DPOTrainer`` on the same model and batch, and a real pretrained LM learning a preference. One
question per ``--what``:

- ``memory``: the qwen2.5-0.5b preset (Qwen2.5-0.5B's exact architecture, random init, saved
  once as a folder that both sides load) at batch 1 × (2 × 1,024 tokens: a prompt+chosen and a
  prompt+rejected sequence of synthetic pairs). Each row is a fresh process through
  effitrain.comparison, a few optimizer steps, the last one measured: peak tensor bytes by kind
  (effitrain's metrics; on TRL's side the same probe, ``trl_side.py``) and the process's peak RSS
  as the kernel counted it. Beside each effitrain row, ``effitrain estimate`` of its options.
- ``learning``: SmolLM2-135M-Instruct (pretrained, offline: benchmarks/checkpoints.py) trained
  with ``effitrain train --task preference`` on pairs it does not already prefer: reward accuracy
  and margins on validation before and after.

    python -m benchmarks.preference.run --what memory
    python -m benchmarks.preference.run --what memory --rows trl-copy effitrain-precompute
    python -m benchmarks.preference.run --what learning
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
from pathlib import Path

from benchmarks import common

TOPIC = common.Topic.of(__file__)
TRL = [sys.executable, "-m", "benchmarks.preference.trl_side"]
"""The TRL side's program (its rows' options are its own, not ``effitrain train``'s)."""
LEVERS = ["--optim", "adafactor", "--weights-dtype", "bf16", "--optimizer-in-backward",
          "--gradient-checkpointing", "--chunked-loss", "torch"]  # fmt: skip
"""Every CPU lever of benchmarks/llm_levers' "all, full fine-tuning" row."""
ROWS: dict[str, tuple[str, str, list[str]]] = {
    "trl-copy": ("TRL `DPOTrainer`, its default reference (a copy), fp32 AdamW", "trl",
                 ["--reference", "copy"]),
    "trl-precompute": ("TRL `DPOTrainer`, `precompute_ref_log_probs=True`", "trl",
                       ["--reference", "precompute"]),
    "trl-copy-checkpointing": ("TRL `DPOTrainer`, a copy, with its default gradient checkpointing",
                               "trl", ["--reference", "copy", "--gradient-checkpointing"]),
    "effitrain-precompute": ("effitrain `--reference precompute`, fp32 AdamW", "effitrain",
                             ["--reference", "precompute"]),
    "effitrain-copy-bf16": ("effitrain `--reference copy --reference-dtype bf16`, fp32 AdamW",
                            "effitrain", ["--reference", "copy", "--reference-dtype", "bf16"]),
    "effitrain-precompute-levers": ("effitrain `--reference precompute` and every CPU lever: "
                                    "bf16 Adafactor in backward, checkpointing, chunked loss",
                                    "effitrain", ["--reference", "precompute", *LEVERS]),
    "effitrain-lora": ("effitrain LoRA rank 16, reference: adapters switched off", "effitrain",
                       ["--lora-rank", "16", "--reference", "adapters"]),
}  # fmt: skip
"""Row name -> (label, side, its options). TRL's options are ``trl_side.py``'s; effitrain's are
``effitrain train`` options on top of the shared ones (fp32 AdamW unless they say otherwise)."""
BASE = "trl-copy"
"""The row every ratio is to: TRL's default."""
PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients", "gradient_bytes"),
    ("optimizer state", "optimizer_state_bytes"),
    ("activations", "activation_bytes"),
    ("reference", "reference_bytes"),
    ("peak tensors", "peak_tensor_bytes"),
    ("peak RSS", "peak_rss_bytes"),
)
PAIRS = 4
"""Training pairs: with 3 steps of batch 1 the measured step is the last (the run's third)."""


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def one_token_words(tokenizer) -> list[str]:
    """Words that the tokenizer encodes as one token each after a space: a text of n of them,
    each after a space, is n tokens (both sides tokenize the same number)."""
    words = sorted(
        token[1:]
        for token in tokenizer.get_vocab()
        if token.startswith("Ġ") and token[1:].isalpha()
    )
    return [w for w in words if tokenizer.tokenize(" " + w) == ["Ġ" + w]]


def write_pairs(folder: Path, tokenizer, max_length: int, pairs: int = PAIRS) -> tuple[Path, Path]:
    """train.jsonl (``pairs`` rows) and validation.jsonl (one row) of synthetic preference pairs
    whose prompt+answer fills ``max_length`` tokens with the eos TRL appends: a prompt of half the
    length and two answers of the rest. For memory and time; nothing here is learnable."""
    words = one_token_words(tokenizer)
    rng = random.Random(0)
    prompt_tokens = max_length // 2 - 1
    answer_tokens = max_length - prompt_tokens - 1  # and the eos

    def text(n: int) -> str:
        return "".join(" " + w for w in rng.choices(words, k=n))

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n in (("train", pairs), ("validation", 1)):
        rows = [
            {"prompt": text(prompt_tokens), "chosen": text(answer_tokens),
             "rejected": text(answer_tokens)}
            for _ in range(n)
        ]  # fmt: skip
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


def model_folder(model: str, cache: Path) -> Path:
    """A causal-LM preset saved once as a folder (model and tokenizer), so that TRL loads what
    effitrain trains; any other name is taken as a checkpoint folder."""
    from effitrain.models import CAUSAL_PRESETS

    if model not in CAUSAL_PRESETS:
        return Path(model).resolve()
    folder = cache / f"causal-{model}"
    if not (folder / "config.json").exists():
        from effitrain.models import load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(model)
        load_causal_lm(model, tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder.resolve()


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------


def memory(args: argparse.Namespace, device: str) -> common.Run:
    from transformers import AutoTokenizer

    from benchmarks.checkpoints import CACHE
    from effitrain.comparison import Configuration

    folder = model_folder(args.model, CACHE)
    train, validation = write_pairs(
        args.work_dir / "data", AutoTokenizer.from_pretrained(folder), args.max_length
    )
    steps = ["--max-steps", str(args.steps)]
    length = ["--max-length", str(args.max_length)]
    effitrain_shared = [
        "--task", "preference", "--model", str(folder), "--train-file", str(train),
        "--validation-file", str(validation), "--batch-size", "1", "--eval-batch-size", "1",
        "--optim", "adamw", "--chunked-loss", "torch", *length, *steps, "--log-every", "1",
        "--save-strategy", "no",
    ]  # fmt: skip
    trl_shared = ["--model", str(folder), "--train-file", str(train), *length, *steps]
    env = common.device_env(device)
    rows, options = [], {}
    for name in args.rows:
        label, side, extra = ROWS[name]
        if side == "trl":
            rows.append(Configuration(name, [*trl_shared, *extra], env, program=TRL))
        else:
            options[name] = [*effitrain_shared, *extra]
            program = [sys.executable, "-m", "effitrain", "train", "--quiet"]
            rows.append(Configuration(name, options[name], env, program=program))
    comparison = common.run_configurations(
        rows, [], args.work_dir / "memory", summarize=summarize
    )  # the options are each row's own: TRL's side takes its own
    when = common.provenance(TOPIC, [], device)
    for row in comparison.rows:
        row["label"] = ROWS[row["row"]][0]
        row["ran"] = {"date": when["date"], "commit": when["effitrain_commit"]}
        if row["row"] in options:
            row.update(estimated(options[row["row"]]))
    settings = {"what": "memory", "model": args.model, "batch_size": 1,
                "max_length": args.max_length, "steps": args.steps, "pairs": PAIRS}  # fmt: skip
    title = f"{args.model}, DPO, batch 1 × (2 × {args.max_length} tokens)"
    run = common.new_run(args, device, title, settings, comparison)
    run["name"] = args.name or f"memory-{device.replace('cuda', 'gpu')}"
    if args.keep_rows:
        kept(run, args.results)
    return run


def kept(run: common.Run, results: Path) -> None:
    """With ``--keep-rows``: the rows of the recorded run of the same name that this one did not
    measure, kept (each row says when it ran), in :data:`ROWS`'s order."""
    old, others = common.rows_not_measured(
        results, TOPIC, run["name"], run["rows"], lambda row: row["row"]
    )
    if old is None or old["settings"] != run["settings"]:
        return
    run["rows"] = sorted(others + run["rows"], key=lambda row: list(ROWS).index(row["row"]))


def summarize(configuration, runs: list[dict]) -> common.Row:
    """One process's numbers, the same keys for both sides."""
    m = runs[0]
    row = {"row": configuration.label, "side": m.get("side", "effitrain")}
    row["peak_rss_bytes"] = common.process_peak(runs)
    row["seconds_per_step"] = m.get("seconds_per_step")
    row["wall_seconds"] = m["process"]["wall_seconds"]
    if row["side"] == "trl":
        step = m.get("step_memory") or {}
        at_peak, peaks = step.get("at_peak", {}), step.get("kind_peaks", {})
        reference = m["reference_bytes"]
        row |= {
            # The tracker files TRL's reference copy's weights as parameters too.
            "parameter_bytes": peaks.get("parameters", 0) - m["reference_parameter_bytes"],
            "gradient_bytes": peaks.get("gradients"),
            "optimizer_state_bytes": m["optimizer_state_bytes"],
            "activation_bytes": peaks.get("activations"),
            "reference_bytes": reference,
            "peak_tensor_bytes": m["peak_tensor_bytes"],
            "at_peak": at_peak,
            "train_loss": m["train_loss"],
            "sequence_tokens": m.get("sequence_tokens"),
        }
        return row
    row |= {key: m.get(key) for _, key in PARTS[:-1] if key != "optimizer_state_bytes"}
    row["optimizer_state_bytes"] = m["optimizer_state"]["bytes"]
    row["reference_bytes"] = reference_bytes(m)
    row["at_peak"] = (m.get("step_memory") or {}).get("at_peak")
    row["train_loss"] = m.get("train_loss")
    row["levers"] = m.get("levers")
    return row


def reference_bytes(metrics: dict) -> int | None:
    """The reference's bytes as effitrain's metrics report them (the copy's weights, the
    precomputed table, or 0 for adapters switched off)."""
    return (metrics.get("reference") or {}).get("bytes")


def estimated(options: list[str]) -> dict:
    """``effitrain estimate`` of a row's own options, in this process: its peak and reference."""
    from effitrain.cli.compare import train_config
    from effitrain.estimation import estimate

    try:
        predicted = estimate(train_config(options))
    except Exception as exc:  # noqa: BLE001 - recorded beside the measurement
        return {"estimate_error": f"{type(exc).__name__}: {exc}"}
    memory = predicted.memory
    return {
        "estimate": {
            "peak_tensor_bytes": memory.peak_tensor_bytes,
            "reference_bytes": (memory.lever_fields.get("reference") or {}).get("bytes"),
        }
    }


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _bytes(value: float) -> str:
    """MiB as the other columns, or bytes where there are fewer than a MiB (a table of 40 B)."""
    return common.mib(value) if value >= 2**20 else common.size(value)


def _estimated(row: dict, key: str) -> str:
    predicted = (row.get("estimate") or {}).get(key)
    measured = row.get(key)
    if predicted is None:
        return row.get("estimate_error", "–") if key == "peak_tensor_bytes" else "–"
    if not measured:
        return _bytes(predicted)
    return f"{_bytes(predicted)} ({(predicted - measured) / measured:+.1%})"


def render_memory(run: common.Run) -> str:
    rows = run["rows"]
    base = next((row for row in rows if row["row"] == BASE), rows[0])
    columns = [common.Column("row", lambda row: row["label"], right=False)]
    columns += [
        common.Column(
            label,
            lambda row, key=key: common.with_ratio(row, base, key, _bytes),
        )
        for label, key in PARTS
    ]
    columns += [
        common.Column("estimated peak (error)", lambda r: _estimated(r, "peak_tensor_bytes")),
        common.Column("estimated reference", lambda r: _estimated(r, "reference_bytes")),
        common.Column("s/step", lambda r: common.shown(r.get("seconds_per_step"), "{:.1f}".format)),
    ]
    ran: dict[tuple, list[str]] = {}
    for row in rows:
        when = row.get("ran") or {}
        ran.setdefault((when.get("date"), when.get("commit")), []).append(f"`{row['row']}`")
    lines = [
        f"- {', '.join(names)}: recorded {date} at effitrain commit `{commit}`"
        for (date, commit), names in ran.items()
    ]
    return common.markdown_table(columns, rows) + "\n\nWhen each row ran:\n\n" + "\n".join(lines)


def render(run: common.Run) -> str:
    what = run["settings"].get("what", "memory")
    return {"memory": render_memory, "learning": render_learning}[what](run)


def render_learning(run: common.Run) -> str:
    columns = [
        common.Column("validation pairs", lambda r: r["when"], right=False),
        common.Column("the model prefers chosen", lambda r: common.shown(r.get("prefers_chosen"), "{:.0%}".format)),
        common.Column("mean log-prob margin chosen − rejected", lambda r: common.shown(r.get("logp_margin"), "{:+.2f}".format)),
        common.Column("reward accuracy", lambda r: common.shown(r.get("reward_accuracy"), "{:.3f}".format)),
        common.Column("reward margin", lambda r: common.shown(r.get("reward_margin"), "{:+.3f}".format)),
        common.Column("eval loss", lambda r: common.shown(r.get("eval_loss"), "{:.4f}".format)),
    ]  # fmt: skip
    parts = [common.markdown_table(columns, run["rows"])]
    s = run.get("summary") or {}
    if s:
        curve = " ".join(f"{v:.2f}" for v in s.get("reward_accuracy_per_eval") or [])
        parts.append(
            f"{s['steps']} steps at lr {common.lr_text(s['lr'])} ({s['options']}), "
            f"{common.shown(s.get('wall_seconds'), '{:.0f}'.format)} s for the whole command; "
            f"validation reward accuracy after each epoch: {curve or '–'}."
        )
    return "\n\n".join(parts)


TOWNS = ["Amber", "Birch", "Cobalt", "Dune", "Elm", "Fern", "Granite", "Hazel"]
NEW_TOWNS = ["Juniper", "Kestrel", "Linden", "Maple"]
"""Validation asks about towns that no training pair names."""


def style_pairs(towns: list[str], days: range) -> list[dict]:
    """Conversational pairs (TRL's format) whose chosen answer is in a house style a pretrained
    chat model does not write on its own, and whose rejected answer is the plain sentence it
    would rather write: a preference it does not already have."""
    rows = []
    for town in towns:
        for day in days:
            question = [
                {"role": "user", "content": f"Where is the market of {town} held on day {day}?"}
            ]
            rows.append({
                "prompt": question,
                "chosen": [{"role": "assistant",
                            "content": f"MARKET REPORT: {town}, day {day}: the square by the river."}],
                "rejected": [{"role": "assistant",
                              "content": f"The market of {town} is held in the town square on day {day}."}],
            })  # fmt: skip
    return rows


def write_style_pairs(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", style_pairs(TOWNS, range(1, 7))),
                       ("validation", style_pairs(NEW_TOWNS, range(1, 5)))):  # fmt: skip
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


def answer_logps(folder: Path, pairs: Path) -> list[tuple[float, float]]:
    """Each pair's summed log-probs of the chosen and the rejected answer under the model in
    ``folder``, tokenized as TRL does (the chat template's prompt with the generation prompt, the
    answer where prompt+answer diverges from it); computed here, outside effitrain, with
    transformers alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    for line in pairs.read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        pair = []
        for answer in ("chosen", "rejected"):
            text = tokenizer.apply_chat_template(row["prompt"] + row[answer], tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            start = next(
                (i for i, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b),
                len(prompt_ids),
            )
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            pair.append(float(logps[start - 1 :].sum()))
        scores.append((pair[0], pair[1]))
    return scores


def preference_row(when: str, scores: list[tuple[float, float]], evaluation: dict | None) -> dict:
    margins = [c - r for c, r in scores]
    row = {"when": when, "prefers_chosen": sum(m > 0 for m in margins) / len(margins),
           "logp_margin": sum(margins) / len(margins)}  # fmt: skip
    if evaluation is None:  # the policy is the reference: every reward is 0
        return row | {"reward_accuracy": 0.0, "reward_margin": 0.0}
    return row | {
        "reward_accuracy": evaluation.get("rewards/accuracies"),
        "reward_margin": evaluation.get("rewards/margins"),
        "eval_loss": evaluation.get("loss"),
    }


def learning(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.checkpoints import model_folder as checkpoint
    from effitrain.comparison import Configuration

    folder = checkpoint("smollm2")
    work = args.work_dir / "learning"
    train, validation = write_style_pairs(work / "data")
    output = work / "output"
    shutil.rmtree(output, ignore_errors=True)  # an earlier run's model: effitrain keeps it
    options = ["--task", "preference", "--model", str(folder), "--train-file", str(train),
               "--validation-file", str(validation), "--batch-size", "4", "--eval-batch-size", "8",
               "--max-length", "128", "--epochs", str(args.learning_epochs), "--log-every", "4",
               "--output-dir", str(output),
               *args.learning_options]  # fmt: skip
    before = answer_logps(folder, validation)
    comparison = common.run_configurations(
        [Configuration("smollm2", options, common.device_env(device),
                       program=[sys.executable, "-m", "effitrain", "train"])],
        [], work / "runs", summarize=lambda c, runs: {"metrics": runs[0]},
    )  # fmt: skip
    if comparison.failed:
        raise SystemExit(f"error: the run failed: {comparison.failed}")
    metrics = comparison.rows[0]["metrics"]
    after = answer_logps(output / "final", validation)
    rows = [preference_row("before: SmolLM2-135M-Instruct as published", before, None),
            preference_row("after `effitrain train --task preference`", after, metrics["eval"])]  # fmt: skip
    summary = {
        "steps": metrics["global_steps"], "lr": metrics["lr"],
        "options": " ".join(args.learning_options) or "full fine-tuning, defaults",
        "wall_seconds": metrics["process"]["wall_seconds"],
        "reward_accuracy_per_eval": [e.get("rewards/accuracies") for e in metrics["eval_history"]],
    }  # fmt: skip
    return {
        "name": args.name or f"learning-{device.replace('cuda', 'gpu')}",
        "title": "SmolLM2-135M-Instruct learns a preference it does not have, "
        f"lr {common.lr_text(metrics['lr'])}, {common.where(device)}",
        "settings": {
            "model": "smollm2",
            "train_pairs": 48,
            "validation_pairs": 16,
            "epochs": args.learning_epochs,
            "options": args.learning_options,
        },  # fmt: skip
        "rows": rows,
        "summary": summary,
        "notes": [],
    }


def measure(args: argparse.Namespace, device: str) -> common.Run:
    run = {"memory": memory, "learning": learning}[args.what](args, device)
    run["settings"] = {"what": args.what, **run.get("settings", {})}
    return run


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--what", choices=["memory", "learning"], default="memory")
    common.add_rows_argument(parser, list(ROWS))
    parser.add_argument("--model", default="qwen2.5-0.5b", help="memory: a preset or a folder")
    parser.add_argument("--max-length", type=int, default=1024, help="memory: tokens a sequence")
    parser.add_argument("--steps", type=int, default=3, help="memory: optimizer steps a row")
    parser.add_argument(
        "--learning-epochs", type=int, default=3, help="learning: epochs of 12 steps (48 pairs)"
    )
    parser.add_argument(
        "--learning-options", type=shlex.split, default=[], metavar="'OPTIONS'",
        help="learning: more `effitrain train` options, quoted: --learning-options='--lr 5e-6'",
    )  # fmt: skip
    parser.add_argument(
        "--keep-rows", action="store_true",
        help="memory: keep the recorded rows (same run name and settings) that --rows leaves out",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
