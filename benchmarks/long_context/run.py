"""Long context: the longest sequence a card trains, what each lever buys at length, and whether
the estimate follows a run at length, packed or not. One question per ``--what``:

- ``cpu``: on this CPU, the tiny-llama preset taking 32,768 positions (saved as a folder, as the
  tests' ``long_lm_model_dir``) at 4k, 8k, 16k and 32k tokens, batch 1, ``effitrain train
  --max-steps 2`` packed (a corpus of 80 documents of 250 to 1,250 words: several per block
  at every length) and unpacked (``--no-packing``: documents longer than the block, so no row
  is padded).
  Per row: ``effitrain estimate``'s peak tensor memory beside the run's measured peak (the same
  options), the error, and seconds per step. Every run and estimate is a fresh process.
- ``levers`` and ``longest``: Llama-3.1-8B and Qwen2.5-7B from their config.json alone
  (:func:`benchmarks.llm_shapes.run.write_config`), QLoRA r16 and full fine-tuning, for a CUDA
  card, batch 1. ``levers``: the peak at one length (32,768 tokens) as levers are added one by
  one (``effitrain estimate``, :data:`LADDER`). ``longest``: the longest length that fits 16,
  24, 48 and 80 GiB (``effitrain plan --max-length longest --json``, the budget as ``plan``
  counts it, margin included), beside unsloth's published figures (:data:`PUBLISHED`).
- ``cuda``: on a GPU, the estimate beside the measured peak at length with the levers the 24
  GiB plan chose for Llama-3.1-8B QLoRA r16 (:data:`CUDA_OPTIONS`: the 4-bit base, lean LoRA
  under bf16 autocast, the tiled norm and MLP, offloaded checkpoints in pinned host memory, the
  optimizer in backward, the chunked loss), on :data:`CUDA_LAYERS` layers of Llama-3.1-8B's
  dimensions (its config.json, random init, saved once as a folder), batch 1, unpacked rows,
  ``--max-steps 2`` at 16k and 32k tokens (``--lengths``). Per row: the estimate's peak, the
  step's measured peak tensors, the CUDA allocator's peak, the host bytes offloaded (estimated
  and measured), seconds per step. ``--shape KEY=VALUE ...`` changes the config (a trial's
  tiny dimensions) and ``--train-options`` the levers (a CPU trial's).

    python -m benchmarks.long_context.run --what cpu
    python -m benchmarks.long_context.run --what cpu --lengths 4096 --results .bench/long.json
    python -m benchmarks.long_context.run --what cpu --layouts packed --keep-rows
    python -m benchmarks.long_context.run --what levers
    python -m benchmarks.long_context.run --what longest
    python -m benchmarks.long_context.run --what longest --models llama-3.1-8b --modes qlora \\
        --budgets 24 --results .bench/long.json
    python -m benchmarks.long_context.run --what cuda --lengths 16384 32768
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common

TOPIC = common.Topic.of(__file__)
LENGTHS = (4096, 8192, 16384, 32768)
"""The CPU run's lengths (tokens per row)."""
LAYOUTS = ("packed", "unpacked")
POSITIONS = 32768
"""The CPU model's positions (the tests' long tiny-llama)."""
WORDS = "the cat sat on a mat while dogs ran over hills and rivers under skies".split()  # noqa: SIM905
"""The corpus' words (the tests' ``long_text_file``)."""
SHAPE_MODELS = ("Llama-3.1-8B", "Qwen2.5-7B")
MODES = {
    "qlora": (
        "QLoRA r16: LoRA r=16 on a 4-bit NF4 base, the rest bf16",
        ["--load-in-4bit", "--lora-rank", "16", "--weights-dtype", "bf16"],
        ["--optim", "adamw"],
    ),
    "full": (
        "full fine-tuning: every weight, bf16 weights",
        ["--weights-dtype", "bf16"],
        ["--full-parameter"],
    ),
}
"""Mode -> (what it is, the options it sets, what ``plan`` is told besides: QLoRA's adapters
train with adamw; full fine-tuning lets the plan choose the optimizer)."""
BUDGETS_GIB = (16, 24, 48, 80)
LEVER_LENGTH = 32768
"""The length the levers' ladder is estimated at."""
LADDER = (
    ("no lever", ["--chunked-loss", "off"]),
    ("+ chunked loss", []),
    ("+ gradient checkpointing", ["--gradient-checkpointing"]),
    ("+ offloaded checkpoints", ["--gradient-checkpointing", "--activation-offload"]),
    ("+ tiled MLP", ["--gradient-checkpointing", "--activation-offload", "--tiled-mlp"]),
    ("+ tiled norm", ["--gradient-checkpointing", "--activation-offload", "--tiled-mlp",
                      "--tiled-norm"]),
    ("+ lean LoRA", ["--gradient-checkpointing", "--activation-offload", "--tiled-mlp",
                     "--tiled-norm", "--lean-lora"]),
)  # fmt: skip
"""Each rung's options on top of the mode's: one lever more than the rung before (the chunked
loss is on by default, so the first rung turns it off). A rung whose option this effitrain
does not have is left out (``--tiled-mlp`` before it lands); ``--lean-lora`` is QLoRA's only
(it changes LoRA's adapters)."""
PUBLISHED = {
    "source": "https://unsloth.ai/blog/llama3-3 (Llama 3.1 8B, QLoRA rank 32 on all linear "
    "layers, batch 1, sequences padded to the length; A100 80 GB, and 24 GB)",
    "rows": {
        "unsloth": {24: 78_475, 80: 342_733},
        "Hugging Face + FlashAttention-2": {24: 5_789, 80: 28_454},
    },
}
"""unsloth's published longest lengths for Llama-3.1-8B QLoRA, by card (GB as sold)."""
PLAN_SECONDS = 90
"""The issue's goal for the 8B QLoRA plan's time, from its start to its answer."""
GOALS = {24: 100_000, 80: 400_000}
"""Issue 46's goals for Llama-3.1-8B QLoRA r16: at least this many tokens per card."""
CUDA_SHAPE = "Llama-3.1-8B"
CUDA_LAYERS = 2
"""The CUDA cell's model: this many layers of this published shape (the rest of its config)."""
CUDA_OPTIONS = [
    "--load-in-4bit", "--weights-dtype", "bf16", "--lora-rank", "16", "--optim", "adamw",
    "--optimizer-in-backward", "--lean-lora", "--gradient-checkpointing", "--tiled-norm",
    "--tiled-mlp", "--activation-offload", "--mixed-precision", "bf16",
]  # fmt: skip
"""The 24 GiB plan's command for Llama-3.1-8B QLoRA r16 (the ``longest`` run's), under bf16
autocast (lean LoRA on bitsandbytes' 4-bit layers is to be checked there)."""
GPU_ARGS = ["--what", "cuda", "--lengths", "16384", "32768"]
"""The GPU variant (benchmarks/gpu.py): 2 lengths, 2 steps each, the estimate beside each."""
TINY_SHAPE = ["hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=2048"]  # fmt: skip
SMOKE_ARGS = ["--what", "cuda", "--lengths", "256", "--shape", *TINY_SHAPE,
              "--train-options=--lora-rank 4 --gradient-checkpointing --tiled-mlp --tiled-norm"]  # fmt: skip
"""A trial of the CUDA cell on any machine (tiny dimensions, the levers a CPU runs): the
plumbing, not the numbers."""


# --------------------------------------------------------------------------------------------
# cpu: estimate beside measured, packed and unpacked
# --------------------------------------------------------------------------------------------


def write_inputs(
    folder: Path, positions: int = POSITIONS, model_name: str = "tiny-llama-32k",
    build: Callable[[Any, int], Any] | None = None,
) -> dict[str, Path]:  # fmt: skip
    """A run's model folder and corpora: the model (made once: ``build(tokenizer, positions)``,
    by default the long tiny-llama), the packed corpus (80 documents of 250 to 1,250 words, each
    under 4,096 tokens: every block holds several, as the estimate's does; a block that is one
    document holds one (length x hidden) tensor a layer less, which the estimate counts) and
    the unpacked one (4 documents of ``positions`` tokens with their end-of-sequence token: the
    run cuts a long document into rows of ``--max-length``, so every row is full at every
    length), each a .txt of blank-line separated documents."""
    from effitrain.demo.lm import build_lm_tokenizer

    paths = {
        "model": folder / model_name,
        "packed": folder / "packed.txt",
        "unpacked": folder / "unpacked.txt",
    }
    tokenizer = build_lm_tokenizer(model_max_length=positions)
    if not paths["model"].exists():
        model = (build or tiny_llama)(tokenizer, positions)
        partial = paths["model"].with_name("partial")  # renamed once whole
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(paths["model"])
    rng = random.Random(0)
    packed = [" ".join(rng.choices(WORDS, k=rng.randint(250, 1250))) for _ in range(80)]
    unpacked = [exact_document(tokenizer, rng, positions - 1) for _ in range(4)]
    for key, documents in (("packed", packed), ("unpacked", unpacked)):
        paths[key].write_text("\n\n".join(documents) + "\n")
    return paths


def tiny_llama(tokenizer, positions: int):
    """The tiny-llama preset taking ``positions`` positions."""
    from effitrain.models import load_causal_lm

    model = load_causal_lm("tiny-llama", tokenizer)
    model.config.max_position_embeddings = positions
    return model


def shape_model(shape: dict[str, Any], device: str) -> Callable[[Any, int], Any]:
    """A builder of the model of config ``shape`` (random init, bf16, built on ``device``: a
    GPU draws a billion weights in a blink), its special tokens the tokenizer's."""

    def build(tokenizer, positions: int):
        import torch
        import transformers

        settings = {key: value for key, value in shape.items() if key != "model_type"}
        settings["max_position_embeddings"] = max(settings["max_position_embeddings"], positions)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            settings[key] = getattr(tokenizer, key)
        config = transformers.AutoConfig.for_model(shape["model_type"], **settings)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return model.cpu()

    return build


def exact_document(tokenizer, rng: random.Random, tokens: int) -> str:
    """A document of :data:`WORDS` that the tokenizer makes exactly ``tokens`` ids of: words
    drawn at random, the last few "a" (one token each; words are tokenized apart)."""
    cost = {word: len(tokenizer(" " + word)["input_ids"]) for word in WORDS}
    words, count = ["a"], len(tokenizer("a")["input_ids"])
    while count < tokens:
        word = rng.choice(WORDS) if tokens - count > max(cost.values()) else "a"
        words.append(word)
        count += cost[word]
    text = " ".join(words)
    made = len(tokenizer(text)["input_ids"])
    if made != tokens:
        raise SystemExit(f"error: a document of {made} tokens, not {tokens}: the tokenizer changed")
    return text


def layout_options(paths: dict[str, Path], layout: str) -> list[str]:
    """A layout's data options: packed blocks of the short documents, or one long document per
    row, unpacked."""
    if layout == "packed":
        return ["--train-file", str(paths["packed"])]
    return ["--train-file", str(paths["unpacked"]), "--no-packing"]


def effitrain_json(command: str, options: list[str], device: str) -> common.Row:
    """``effitrain <command> ... --json`` in a fresh process: its JSON, or its refusal or
    failure, and the seconds it took."""
    argv = [sys.executable, "-m", "effitrain", command, *options, "--json"]
    env = {**os.environ, **common.device_env(device), "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_OFFLINE"] = "1"
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=common.REPO)
    seconds = round(time.monotonic() - start, 1)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        if errors:
            return {"refused": errors[0].removeprefix("error:").strip(), "seconds": seconds}
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit {proc.returncode}: {tail}", "seconds": seconds}
    return {**json.loads(proc.stdout), "seconds": seconds}


def measure_cpu(args: argparse.Namespace, device: str) -> common.Run:
    paths = write_inputs(args.work_dir / "inputs")
    rows, notes = estimates_and_runs(args, device, paths, args.layouts, [])
    name = args.name or "cpu"
    if args.keep_rows:
        rows = kept(rows, args.results, name, notes)
    return {
        "name": name,
        "title": f"tiny-llama at {POSITIONS:,} positions, batch 1, "
        f"{common.where(device)}: estimate beside measured",
        "settings": {
            "what": "cpu",
            "lengths": sorted({row["max_length"] for row in rows}),
            "layouts": [layout for layout in LAYOUTS if any(r["layout"] == layout for r in rows)],
        },
        "rows": rows,
        "notes": notes,
        "failed": any("failed" in note for note in notes),
    }


def measure_cuda(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.llm_shapes.run import MODELS

    shape = {**MODELS[CUDA_SHAPE], "num_hidden_layers": CUDA_LAYERS, **dict(args.shape)}
    name = f"{CUDA_SHAPE}-{CUDA_LAYERS}-layers" + "".join(f"-{k}{v}" for k, v in args.shape)
    build = shape_model(shape, device)
    paths = write_inputs(args.work_dir / "inputs", max(args.lengths), name, build)
    options = args.train_options.split()
    rows, notes = estimates_and_runs(args, device, paths, ["unpacked"], options)
    changed = " (changed: see settings)" if args.shape else ""
    plans = options == CUDA_OPTIONS
    levers = "QLoRA r16 with the 24 GiB plan's levers" if plans else "the levers below"
    return {
        "name": args.name or device.replace("cuda", "gpu"),
        "title": f"{CUDA_LAYERS} layers of {CUDA_SHAPE}'s dimensions{changed}, {levers}, batch 1, "
        f"{common.where(device)}: estimate beside measured",
        "settings": {
            "what": "cuda",
            "lengths": args.lengths,
            "shape": dict(args.shape),
            "options": options,
        },
        "rows": rows,
        "notes": notes,
        "failed": any("failed" in note for note in notes),
    }


def estimates_and_runs(
    args: argparse.Namespace, device: str, paths: dict[str, Path], layouts: list[str],
    options: list[str],
) -> tuple[list[common.Row], list[str]]:  # fmt: skip
    """Per length and layout, ``effitrain estimate`` and a 2-step run of the same options
    (each a fresh process): the rows, and notes of what was refused, skipped or failed."""
    from effitrain.comparison import Configuration

    model = ["--task", "causal-lm", "--model", str(paths["model"]), "--batch-size", "1"]
    shared = [*model, "--max-steps", "2", "--save-strategy", "no", "--log-every", "1"]
    rows, notes = [], []
    for length in args.lengths:
        for layout in layouts:
            if (layout, length) in args.skip:
                notes.append(f"{layout} at {length:,} tokens not run (--skip)")
                continue
            given = [*layout_options(paths, layout), "--max-length", str(length), *options]
            print(f"{layout} {length}: estimate, then train", file=sys.stderr, flush=True)
            described = ["--device", "cuda"] if device == "cuda" else []
            predicted = effitrain_json("estimate", [*model, *given, *described], device)
            label = f"{layout} {length}"
            comparison = common.run_configurations(
                [Configuration(label=label, args=given, env=common.device_env(device))],
                shared,
                args.work_dir / "runs",
                summarize=summarize,
            )
            row: common.Row = {"layout": layout, "max_length": length}
            row["estimate_peak_tensor_bytes"] = predicted.get("peak_tensor_bytes")
            row["estimate_host_bytes"] = predicted.get("activation_offload_host_bytes")
            row["estimate_seconds"] = predicted["seconds"]
            if "peak_tensor_bytes" not in predicted:
                notes.append(f"{label}: estimate {predicted.get('refused') or predicted['failed']}")
            if comparison.rows:
                row.update(comparison.rows[0])
            else:
                notes += [f"{label} failed: {error}" for error in comparison.failed.values()]
            rows.append(row)
    return rows, notes


def kept(rows: list[common.Row], results: Path, name: str, notes: list[str]) -> list[common.Row]:
    """With ``--keep-rows``: ``rows`` and the rows of the recorded run ``name`` that they do not
    measure again, by length then layout; ``notes`` says which were kept, from which run."""
    old, others = common.rows_not_measured(
        results, TOPIC, name, rows, lambda row: (row["layout"], row["max_length"])
    )
    if old is None:
        return rows
    if others:
        cells = ", ".join(f"{row['layout']} {row['max_length']:,}" for row in others)
        ran = old["provenance"]
        notes.append(
            f"{cells}: kept from the run of {ran['date']} at effitrain commit "
            f"`{ran.get('effitrain_commit')}`"
        )
    order = {layout: index for index, layout in enumerate(LAYOUTS)}
    return sorted([*others, *rows], key=lambda r: (r["max_length"], order[r["layout"]]))


def summarize(configuration, runs: list[dict]) -> common.Row:
    first = runs[0]
    return {
        "peak_tensor_bytes": first["peak_tensor_bytes"],
        "peak_memory_bytes": first["peak_memory_bytes"],
        "peak_memory_kind": first["peak_memory_kind"],
        "host_bytes": first.get("activation_offload_host_bytes"),
        "cuda_max_reserved": (first.get("step_memory") or {}).get("cuda_max_reserved"),
        "seconds_per_step": common.median(runs, "seconds_per_step"),
    }


def _by_length(run: common.Run) -> list[common.Row]:
    """One row per length: the packed and unpacked rows side by side."""
    merged: dict[int, common.Row] = {}
    for row in run["rows"]:
        merged.setdefault(row["max_length"], {"max_length": row["max_length"]})[row["layout"]] = row
    return [merged[length] for length in sorted(merged)]


def _cell(layout: str, cell) -> common.Column:
    return common.Column(
        f"{layout}: {cell.__doc__}", lambda r: cell(r[layout]) if layout in r else "–"
    )


def _estimate(row: common.Row) -> str:
    """estimate"""
    return common.shown(row.get("estimate_peak_tensor_bytes"), common.mib)


def _measured(row: common.Row) -> str:
    """measured"""
    return common.shown(row.get("peak_tensor_bytes"), common.mib)


def _error_cell(row: common.Row) -> str:
    """error"""
    return common.estimate_error(row, missing="–")


def _seconds(row: common.Row) -> str:
    """s/step"""
    return common.shown(row.get("seconds_per_step"), common.seconds)


def _packed_over_unpacked(row: common.Row) -> str:
    packed, unpacked = row.get("packed", {}), row.get("unpacked", {})
    if not packed.get("peak_tensor_bytes") or not unpacked.get("peak_tensor_bytes"):
        return "–"
    return f"{packed['peak_tensor_bytes'] / unpacked['peak_tensor_bytes']:.2f}×"


def render_cpu(run: common.Run) -> str:
    columns = [common.Column("tokens", lambda r: f"{r['max_length']:,}")]
    for layout in LAYOUTS:
        columns += [_cell(layout, c) for c in (_estimate, _measured, _error_cell, _seconds)]
    columns.append(common.Column("packed / unpacked (measured)", _packed_over_unpacked))
    table = common.markdown_table(columns, _by_length(run))
    errors = [
        abs(r["estimate_peak_tensor_bytes"] - r["peak_tensor_bytes"]) / r["peak_tensor_bytes"]
        for r in run["rows"]
        if isinstance(r.get("peak_tensor_bytes"), int)
        and isinstance(r.get("estimate_peak_tensor_bytes"), int)
    ]
    lines = []
    if errors:
        worst = max(errors)
        verdict = "met" if worst <= 0.02 else "not met"
        lines.append(f"**Goal:** estimate within 2 % of measured: {verdict} (worst {worst:.1%}).")
    at_16k = next((r for r in _by_length(run) if r["max_length"] == 16384), None)
    ratio = _packed_over_unpacked(at_16k) if at_16k else "–"
    if ratio != "–":
        verdict = "met" if float(ratio.rstrip("×")) <= 1.1 else "not met"
        lines.append(f"**Goal:** a packed 16k block within 1.1× of unpacked: {verdict} ({ratio}).")
    return "\n\n".join([table, *lines])


def render_cuda(run: common.Run) -> str:
    columns = [
        common.Column("tokens", lambda r: f"{r['max_length']:,}"),
        common.Column("estimate", _estimate),
        common.Column("measured (step's tensors)", _measured),
        common.Column("error", _error_cell),
        common.Column("run's peak", lambda r: common.shown(r.get("peak_memory_bytes"), common.mib)),
        common.Column("reserved (step)", lambda r: common.shown(r.get("cuda_max_reserved"), common.mib)),
        common.Column("host: offloaded (est.)", lambda r: f"{common.shown(r.get('host_bytes'), common.mib)} ({common.shown(r.get('estimate_host_bytes'), common.mib)})"),
        common.Column("s/step", _seconds),
    ]  # fmt: skip
    options = " ".join(run["settings"]["options"])
    return (
        f"{common.markdown_table(columns, run['rows'])}\n\nLevers: `{options}`. The run's peak: "
        "`max_memory_allocated` on CUDA (peak RSS on a CPU); reserved: the caching allocator's "
        "most over the measured step."
    )


# --------------------------------------------------------------------------------------------
# shapes: the longest length per card, and what each lever buys
# --------------------------------------------------------------------------------------------


def has_option(flag: str) -> bool:
    """Whether this effitrain has ``flag`` (a lever that may not have landed)."""
    import effitrain.levers  # noqa: F401 - registering the levers adds their options
    from effitrain.config import OPTIONS, option

    return flag in {option(name) for name in OPTIONS}


def longest_row(folder: Path, mode: str, budget: int) -> common.Row:
    """``effitrain plan --max-length longest`` for a CUDA card of ``budget`` GiB."""
    _, options, plan_options = MODES[mode]
    result = effitrain_json(
        "plan",
        ["--task", "causal-lm", "--model", str(folder), "--max-length", "longest",
         "--memory", f"{budget}GiB", "--device", "cuda", *options, *plan_options],
        "cpu",
    )  # fmt: skip
    row: common.Row = {"seconds": result["seconds"]}
    if "longest" not in result:
        row["refused" if "refused" in result else "failed"] = (
            result.get("refused") or result.get("failed") or "no 'longest' in plan --json"
        )
        return row
    best = result["candidates"][0]
    row.update(
        longest=result["longest"],
        command=best["command"],
        peak_tensor_bytes=best["peak_tensor_bytes"],
        host_peak_bytes=best.get("host_peak_bytes"),
        levers=sorted(best["levers"]),
    )
    return row


def measure_shapes(args: argparse.Namespace, device: str) -> common.Run:
    """``levers`` or ``longest``: per model and mode, the ladder's estimates at one length, or
    the longest length per budget."""
    from benchmarks.llm_shapes.run import MODELS, estimate_row, write_config

    names = {name.lower(): name for name in MODELS}
    rows = []
    flags = {flag for _, extra in LADDER for flag in extra if flag.startswith("--")}
    missing = {flag for flag in flags if not has_option(flag)}
    ladder = [(label, extra) for label, extra in LADDER if not missing & set(extra)]
    for model in (names[m.lower()] for m in args.models):
        folder = write_config(args.work_dir / "models", model)
        # Named from the repository (the commands run there): the recorded commands hold
        # no machine's absolute path.
        if folder.resolve().is_relative_to(common.REPO):
            folder = folder.resolve().relative_to(common.REPO)
        for mode in args.modes:
            base = {"model": model, "mode": mode}
            for label, extra in ladder if args.what == "levers" else []:
                if mode == "full" and "--lean-lora" in extra:
                    continue
                print(f"{model} {mode}: {label}", file=sys.stderr, flush=True)
                row = estimate_row(folder, [*MODES[mode][1], *extra], 1, args.lever_length)
                rows.append({**base, "rung": label, **row})
            for budget in args.budgets if args.what == "longest" else []:
                print(f"{model} {mode}: longest at {budget} GiB", file=sys.stderr, flush=True)
                rows.append({**base, "budget_gib": budget, **longest_row(folder, mode, budget)})
    settings = {"what": args.what, "modes": {mode: MODES[mode][:2] for mode in args.modes}}
    if args.what == "levers":
        settings.update(lever_length=args.lever_length, ladder=[label for label, _ in ladder])
        title = f"what each lever buys at {args.lever_length:,} tokens"
    else:
        settings["budgets_gib"] = args.budgets
        title = "the longest length per card"
    failed = [r for r in rows if "failed" in r]
    return {
        "name": args.name or args.what,
        "title": f"Llama-3.1-8B and Qwen2.5-7B for a CUDA card, batch 1: {title} (estimates)",
        "settings": settings,
        "rows": rows,
        "notes": [f"{r['model']} {r['mode']}: failed: {r['failed']}" for r in failed],
        "failed": bool(failed),
    }


def _longest_cell(row: common.Row | None) -> str:
    if row is None:
        return "–"
    if "longest" in row:
        return f"{row['longest']:,}"
    return "refused" if "refused" in row else "failed"


def render_longest(run: common.Run) -> str:
    budgets = run["settings"]["budgets_gib"]
    rows = run["rows"]
    table_rows = []
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in rows):
        cells = {r["budget_gib"]: r for r in rows if (r["model"], r["mode"]) == (model, mode)}
        table_rows.append({"who": f"effitrain, {model} {mode}", "cells": cells})
    for who, figures in PUBLISHED["rows"].items():
        table_rows.append({"who": f"{who} (published), Llama-3.1-8B QLoRA", "published": figures})

    def cell(row: common.Row, gib: int) -> str:
        if "published" in row:
            return f"{row['published'][gib]:,}" if gib in row["published"] else "–"
        return _longest_cell(row["cells"].get(gib))

    columns = [common.Column("longest tokens, batch 1", lambda r: r["who"], right=False)]
    columns += [common.Column(f"{gib} GiB", lambda r, g=gib: cell(r, g)) for gib in budgets]
    parts = [common.markdown_table(columns, table_rows)]
    goal_rows = [r for r in rows if (r["model"], r["mode"]) == ("Llama-3.1-8B", "qlora")]
    for gib, goal in GOALS.items():
        found = next((r for r in goal_rows if r["budget_gib"] == gib), None)
        if found is not None:
            reached = found.get("longest")
            verdict = "met" if isinstance(reached, int) and reached >= goal else "not met"
            parts.append(
                f"**Goal:** Llama-3.1-8B QLoRA r16 at {gib} GiB ≥ {goal:,} tokens: {verdict} "
                f"({_longest_cell(found)}; unsloth {PUBLISHED['rows']['unsloth'][gib]:,})."
            )
    timed = [r for r in goal_rows if isinstance(r.get("seconds"), int | float)]
    if timed:
        slowest = max(r["seconds"] for r in timed)
        verdict = "met" if slowest <= PLAN_SECONDS else "not met"
        each = ", ".join(f"{r['seconds']:.0f} s at {r['budget_gib']} GiB" for r in timed)
        parts.append(
            f"**Goal:** `plan --max-length longest` for Llama-3.1-8B QLoRA r16 answers in ≤ "
            f"{PLAN_SECONDS} s: {verdict} ({each}; each plan a fresh process, by the clock, on "
            "this machine while nothing else ran)."
        )
    commands = [
        f"- {r['model']} {r['mode']}, {r['budget_gib']} GiB: `{r['command']}`"
        for r in rows
        if "command" in r
    ]
    refusals = [
        f"- {r['model']} {r['mode']}, {r['budget_gib']} GiB: {r.get('refused') or r['failed']}"
        for r in rows
        if "longest" not in r
    ]
    return "\n\n".join(parts + ["\n".join(lines) for lines in (commands, refusals) if lines])


def render_levers(run: common.Run) -> str:
    previous: dict[tuple[str, str], int] = {}

    def saved(row: common.Row) -> str:
        key, peak = (row["model"], row["mode"]), row.get("peak_tensor_bytes")
        before, previous[key] = previous.get(key), peak
        if not isinstance(peak, int) or not isinstance(before, int):
            return "–"
        return common.size(before - peak)

    def peak(row: common.Row) -> str:
        if "peak_tensor_bytes" not in row:
            return "refused" if "refused" in row else "failed"
        return common.size(row["peak_tensor_bytes"])

    columns = [
        common.Column("model", lambda r: r["model"], right=False),
        common.Column("mode", lambda r: r["mode"], right=False),
        common.Column("levers", lambda r: r["rung"], right=False),
        common.Column("peak", peak),
        common.Column("saved", saved),
        common.Column("activations", lambda r: common.shown(r.get("activation_bytes"), common.size)),
        common.Column("offloaded to the host", lambda r: common.shown(r.get("activation_offload_host_bytes"), common.size)),
        common.Column("host RAM", lambda r: common.shown(r.get("host_peak_bytes"), common.size)),
    ]  # fmt: skip
    return common.markdown_table(columns, run["rows"])


def render(run: common.Run) -> str:
    renderers = {"cpu": render_cpu, "cuda": render_cuda, "levers": render_levers}
    renderers["longest"] = render_longest
    return renderers[run["settings"]["what"]](run)


def measure(args: argparse.Namespace, device: str) -> common.Run:
    measures = {"cpu": measure_cpu, "cuda": measure_cuda}
    return measures.get(args.what, measure_shapes)(args, device)


def _skip(text: str) -> tuple[str, int]:
    layout, _, length = text.partition(":")
    return layout, int(length)


def _setting(text: str) -> tuple[str, int]:
    key, _, value = text.partition("=")
    return key, int(value)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument("--what", choices=["cpu", "cuda", "levers", "longest"], default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="cpu, cuda")
    parser.add_argument(
        "--shape", nargs="+", type=_setting, default=[], metavar="KEY=VALUE",
        help=f"cuda: change {CUDA_SHAPE}'s config (a trial's tiny dimensions)",
    )  # fmt: skip
    parser.add_argument(
        "--train-options", default=" ".join(CUDA_OPTIONS), help="cuda: the levers (one string)"
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument(
        "--keep-rows", action="store_true",
        help="cpu: keep the recorded run's rows (same run name) that --lengths and --layouts "
        "leave out",
    )  # fmt: skip
    parser.add_argument(
        "--skip", nargs="+", type=_skip, default=[], metavar="LAYOUT:LENGTH",
        help="cpu: leave these out (packed:32768: a step too slow here)",
    )  # fmt: skip
    parser.add_argument("--models", nargs="+", default=[m.lower() for m in SHAPE_MODELS])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS_GIB))
    parser.add_argument("--lever-length", type=int, default=LEVER_LENGTH)
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
