"""``--task causal-lm``: does the demo learn, what packing buys over padding, which model
architectures keep packed documents apart, and the fine-tuning defaults on a real pretrained
causal LM. One question per ``--what``:

- ``demo``: ``effitrain train --task causal-lm`` with its defaults (tiny-llama, random init, the
  built-in corpus): validation perplexity and a greedy sample after each epoch, time, tokens/s.
- ``packing``: one epoch packed and one padded (steps, tokens/s, perplexity), then, without
  training, the real (non-pad) tokens per batch of each at several --max-length values.
- ``architectures``: for tiny random models of many types, whether a packed block's logits equal
  each document's run alone (sdpa and eager attention): where packing is safe.
- ``smollm2``: SmolLM2-135M-Instruct (pretrained, benchmarks/checkpoints.py) fine-tuned for a few
  steps on the built-in corpus with each optimizer's default lr: validation perplexity, sample.

Training runs are fresh ``effitrain train`` processes through effitrain.comparison.

    python -m benchmarks.causal_lm.run --what demo
    python -m benchmarks.causal_lm.run --what packing --lengths 128 512
    python -m benchmarks.causal_lm.run --what architectures
    python -m benchmarks.causal_lm.run --what smollm2 --optims adamw adafactor adamw-8bit lion
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from benchmarks import common

TOPIC = common.Topic.of(__file__)
ARCHITECTURES = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "ministral",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "smollm3",
    "gpt2",
    "gpt_neox",
    "gptj",
    "codegen",
    "gpt_bigcode",
    "falcon",
    "olmo",
    "olmo2",
    "olmo3",
    "granite",
    "granitemoe",
    "stablelm",
    "starcoder2",
    "cohere",
    "glm4",
    "helium",
    "llama4_text",
    "opt",
    "bloom",
    "mpt",
    "xglm",
    "biogpt",
]
"""Model types checked by ``--what architectures``."""
GPU_ARGS = ["--what", "demo", "--name", "demo-gpu"]
SMOKE_ARGS = ["--what", "packing", "--max-steps", "2", "--lengths", "64"]


def measure(args: argparse.Namespace, device: str) -> common.Run:
    run = {"demo": demo, "packing": packing, "architectures": architectures, "smollm2": smollm2}[
        args.what
    ](args, device)
    run.setdefault("name", args.name or f"{args.what}-{device.replace('cuda', 'gpu')}")
    run["title"] += f", {common.where(device)}"
    run["settings"] = {"what": args.what, **run.get("settings", {})}
    return run


def _train(args, device, configurations, shared) -> list[common.Row]:
    """Run effitrain configurations; their rows (the whole metrics, for the topic to pick from)."""
    env = common.device_env(device)
    for configuration in configurations:
        configuration.env = env
    if args.max_steps:
        shared = [*shared, "--max-steps", str(args.max_steps)]
    comparison = common.run_configurations(
        configurations, shared, args.work_dir / args.what,
        summarize=lambda c, runs: {"label": c.label, "metrics": runs[0]},
    )  # fmt: skip
    if comparison.failed:
        raise SystemExit(f"error: a run failed: {comparison.failed}")
    return comparison.rows


def demo(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration

    (row,) = _train(args, device, [Configuration(label="demo")], ["--task", "causal-lm"])
    metrics = row["metrics"]
    rows = [
        {
            "epoch": i + 1,
            "loss": e["loss"],
            "perplexity": e["perplexity"],
            "sample": e.get("sample"),
        }
        for i, e in enumerate(metrics["eval_history"])
    ]
    summary = {
        "steps": metrics["global_steps"],
        "train_seconds": metrics["train_seconds"],
        "tokens_per_second": metrics["tokens_per_second"],
        "wall_seconds": metrics["process"]["wall_seconds"],
    }
    return {
        "title": "the demo: tiny-llama on the built-in corpus",
        "rows": rows,
        "summary": summary,
    }


def packing(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.comparison import Configuration

    shared = ["--task", "causal-lm", "--epochs", "1", "--batch-size", str(args.batch_size)]
    shared += ["--max-length", str(args.max_length)]
    runs = _train(
        args, device,
        [Configuration(label="packed"), Configuration(label="padded", args=["--no-packing"])],
        shared,
    )  # fmt: skip
    rows = [
        {"layout": r["label"], "steps": r["metrics"]["global_steps"],
         "tokens_per_second": r["metrics"]["tokens_per_second"],
         "perplexity": r["metrics"]["eval"]["perplexity"]}
        for r in runs
    ]  # fmt: skip
    batches = [batch_statistics(length, args.batch_size) for length in args.lengths]
    return {
        "title": f"packing or padding, batch {args.batch_size}, the built-in corpus",
        "settings": {"batch_size": args.batch_size, "max_length": args.max_length},
        "rows": rows,
        "batches": [row for rows in batches for row in rows],
    }


def batch_statistics(max_length: int, batch_size: int) -> list[common.Row]:
    """Batches per epoch and real tokens per batch, packed and padded, at ``max_length``."""
    import json
    import tempfile
    from pathlib import Path

    from effitrain.config import TrainConfig
    from effitrain.demo.lm import build_demo_corpus
    from effitrain.models import load_tokenizer
    from effitrain.tasks.lm_data import build_lm_dataloaders, load_lm_data

    texts = list(build_demo_corpus()["train"]["text"])
    tokenizer = load_tokenizer("tiny-llama")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        for packed in (True, False):
            config = TrainConfig(train_file=str(path), validation_file=str(path), task="causal-lm",
                                 max_length=max_length, batch_size=batch_size, packing=packed)  # fmt: skip
            loader, _ = build_lm_dataloaders(load_lm_data(config), tokenizer, config)
            slots = real = 0
            batches = list(loader)
            for batch in batches:
                mask = batch.get("attention_mask")
                slots += batch["input_ids"].numel()
                real += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            rows.append({"max_length": max_length, "layout": "packed" if packed else "padded",
                         "batches": len(batches), "real_tokens_per_batch": real / len(batches),
                         "real_share": real / slots})  # fmt: skip
    return rows


def architectures(args: argparse.Namespace, device: str) -> common.Run:
    """Does a packed block (position ids restarting per document, no mask) give each document's
    own logits? Tiny random models, sdpa and eager attention, and effitrain's document attention
    (SDPA per document, told the documents' lengths) where the architecture takes it."""
    rows = [check_architecture(model_type) for model_type in args.types or ARCHITECTURES]
    return {"title": "which architectures keep packed documents apart", "rows": rows}


def check_architecture(model_type: str) -> common.Row:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import effitrain.tasks.document_attention as document_attention

    document_attention.MASKED_UP_TO = 0  # per document at this block's 16 tokens too
    options = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
               "head_dim": 16, "max_position_embeddings": 64, "pad_token_id": 0}  # fmt: skip
    options |= {"gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8}}.get(model_type, {})
    if model_type == "falcon":
        del options["head_dim"]
    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 10, 11, 12, 13, 14, 15, 3, 20, 21, 22]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    documents = [(0, 6), (6, 13), (13, 16)]
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **options)).eval()
    except Exception as exc:  # a config this generic recipe cannot build
        return {"model_type": model_type, "sdpa": f"not built: {type(exc).__name__}", "eager": ""}
    row = {"model_type": model_type}
    for attention in ("sdpa", "eager", "documents"):
        extra: dict = {}
        given = contextlib.nullcontext()
        try:
            model.set_attn_implementation("sdpa" if attention == "documents" else attention)
            if attention != "documents":
                pass
            elif document_attention.use(model):
                extra = {"document_lengths": ((6, 7, 3),)}
                given = document_attention.documents_given()
            else:  # not taken: the architecture keeps transformers' own attention
                row[attention] = "not used"
                continue
        except Exception:
            row[attention] = "n/a"
            continue
        with torch.no_grad(), given:
            packed = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits[
                0
            ]
            diff = max(
                (packed[a:b] - model(input_ids=ids[:, a:b]).logits[0]).abs().max().item()
                for a, b in documents
            )
        row[attention] = f"{'ok' if diff < 1e-5 else 'LEAKS'} ({diff:.0e})"
    return row


def smollm2(args: argparse.Namespace, device: str) -> common.Run:
    from benchmarks.checkpoints import model_folder
    from effitrain.comparison import Configuration

    folder = model_folder("smollm2")
    shared = ["--task", "causal-lm", "--model", str(folder), "--dataset", "demo", "--batch-size",
              "8", "--max-length", "128", "--eval-batch-size", "16", "--max-steps", str(args.steps),
              "--sample-prompt", "On Monday, the committee"]  # fmt: skip
    configurations = [Configuration(label=o, args=["--optim", o]) for o in args.optims]
    rows = []
    for row in _train(args, device, configurations, shared):
        metrics = row["metrics"]
        rows.append({"optimizer": row["label"], "lr": metrics["lr"],
                     "perplexity": metrics["eval"]["perplexity"],
                     "seconds_per_step": metrics["seconds_per_step"],
                     "sample": metrics["eval_history"][-1].get("sample")})  # fmt: skip
    return {
        "title": f"SmolLM2-135M-Instruct, {args.steps} steps on the built-in corpus",
        "rows": rows,
    }


def render(run: common.Run) -> str:
    what = run["settings"]["what"]
    text = lambda key, fmt=str: lambda r: common.shown(r.get(key), fmt)  # noqa: E731
    quoted = lambda key: lambda r: f'"{r[key].strip()}"' if r.get(key) else "–"  # noqa: E731
    columns = {
        "demo": [("epoch", text("epoch")), ("validation loss", text("loss", "{:.4f}".format)),
                 ("perplexity", text("perplexity", "{:.2f}".format)), ("sample", quoted("sample"))],
        "packing": [("layout", text("layout")), ("steps", text("steps")),
                    ("tokens/s", text("tokens_per_second", "{:,.0f}".format)),
                    ("perplexity after 1 epoch", text("perplexity", "{:.2f}".format))],
        "architectures": [("model type", text("model_type")), ("sdpa", text("sdpa")),
                          ("eager", text("eager")), ("documents", text("documents"))],
        "smollm2": [("optimizer", text("optimizer")), ("lr", text("lr", common.lr_text)),
                    ("validation perplexity", text("perplexity", "{:.2f}".format)),
                    ("s/step", text("seconds_per_step", "{:.1f}".format)),
                    ('sample after "On Monday, the committee"', quoted("sample"))],
    }[what]  # fmt: skip
    left = {"epoch", "layout", "model type", "optimizer", "sample"}
    table = [
        common.Column(h, cell, right=h not in left and "sample" not in h) for h, cell in columns
    ]
    parts = [common.markdown_table(table, run["rows"], drop_empty=True)]
    if run.get("summary"):
        s = run["summary"]
        parts.append(
            f"{s['steps']} steps, {common.shown(s['train_seconds'], '{:.1f}'.format)} s of training "
            f"({common.shown(s['tokens_per_second'], '{:,.0f}'.format)} tokens/s), "
            f"{common.shown(s['wall_seconds'], '{:.0f}'.format)} s for the whole command."
        )
    if run.get("batches"):
        parts.append(batch_table(run["batches"]))
    return "\n\n".join(parts)


def batch_table(rows: list[common.Row]) -> str:
    columns = [
        common.Column("--max-length", lambda r: str(r["max_length"])),
        common.Column("layout", lambda r: r["layout"], right=False),
        common.Column("batches per epoch", lambda r: common.shown(r.get("batches"), str)),
        common.Column("real tokens per batch", lambda r: common.shown(r.get("real_tokens_per_batch"), "{:,.0f}".format)),
        common.Column("real share of a batch", lambda r: common.shown(r.get("real_share"), "{:.0%}".format)),
    ]  # fmt: skip
    return common.markdown_table(columns, rows, drop_empty=True)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    parser.add_argument(
        "--what", choices=["demo", "packing", "architectures", "smollm2"], default="demo"
    )
    parser.add_argument("--max-steps", type=int, help="cut the training runs short (trials)")
    parser.add_argument("--batch-size", type=int, default=16, help="packing: the batch size")
    parser.add_argument("--max-length", type=int, default=128, help="packing: the trained length")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[128, 512], help="packing: lengths counted"
    )
    parser.add_argument(
        "--types", nargs="+", help="architectures: model types (default: all listed)"
    )
    parser.add_argument("--optims", nargs="+", default=["adamw", "adafactor", "adamw-8bit", "lion"])
    parser.add_argument("--steps", type=int, default=15, help="smollm2: optimizer steps")
    args = parser.parse_args(argv)
    return common.main(TOPIC, args, argv, measure, render)


if __name__ == "__main__":
    sys.exit(main())
