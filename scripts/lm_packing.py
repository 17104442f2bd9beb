"""Packing vs padding for causal-LM data: real (non-pad) tokens per batch, and which model
architectures keep packed documents apart.

    python scripts/lm_packing.py [--max-length 128] [--batch-size 16] [--architectures]

The data is the built-in demo corpus when effitrain.demo.lm exists, else generated documents of
varied length; the tokenizer is a byte-level BPE trained on that data. ``--architectures``
checks, for tiny random models of many types, that a packed block's logits equal those of
each document run alone (sdpa and eager attention).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def documents() -> tuple[list[str], str]:
    try:
        from effitrain.demo.lm import build_demo_corpus

        return list(build_demo_corpus()["train"]["text"]), "built-in demo corpus"
    except ImportError:
        rng = random.Random(0)
        words = [
            "the",
            "a",
            "river",
            "cat",
            "sea",
            "house",
            "walks",
            "runs",
            "old",
            "new",
            "by",
            "on",
            "in",
            "to",
            "of",
            "and",
        ]
        docs = [
            " ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(3.5, 0.8))))
            for _ in range(2000)
        ]
        return docs, "2000 generated documents, lognormal lengths (median ~33 words)"


def tokenizer_for(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def throughput(max_length: int, batch_size: int) -> None:
    import json

    from effitrain.config import TrainConfig
    from effitrain.tasks.lm_data import IGNORE_INDEX, build_lm_dataloaders, load_lm_data

    texts, what = documents()
    tokenizer = tokenizer_for(texts)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        print(f"data: {what}; --max-length {max_length}, --batch-size {batch_size}")
        for packing in (True, False):
            config = TrainConfig(
                train_file=str(path),
                validation_file=str(path),
                max_length=max_length,
                batch_size=batch_size,
                packing=packing,
            )
            data = load_lm_data(config)
            loader, _ = build_lm_dataloaders(data, tokenizer, config)
            slots = real = trained = 0
            batches = list(loader)
            for batch in batches:
                ids = batch["input_ids"]
                slots += ids.numel()
                mask = batch.get("attention_mask")
                real += int(mask.sum()) if mask is not None else ids.numel()
                trained += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            name = "packing" if packing else "padding"
            print(
                f"{name}: {len(batches)} batches/epoch, {real / len(batches):.0f} real tokens "
                f"per batch of {slots / len(batches):.0f} slots ({real / slots:.0%} real), "
                f"{trained} trained-on tokens/epoch"
            )


def architectures() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64}
    small |= {"head_dim": 16, "max_position_embeddings": 64, "pad_token_id": 0}
    extra = {"gptj": {"rotary_dim": 8}, "codegen": {"rotary_dim": 8}, "falcon": {"head_dim": None}}
    types = [
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
    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 10, 11, 12, 13, 14, 15, 3, 20, 21, 22]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    documents = [(0, 6), (6, 13), (13, 16)]
    for model_type in types:
        options = {k: v for k, v in {**small, **extra.get(model_type, {})}.items() if v is not None}
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **options)
            ).eval()
        except Exception as exc:  # a config this generic recipe cannot build
            print(f"{model_type:14s} not built: {type(exc).__name__}")
            continue
        results = []
        for attention in ("sdpa", "eager"):
            try:
                model.set_attn_implementation(attention)
            except Exception:
                results.append(f"{attention}: n/a")
                continue
            with torch.no_grad():
                packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
                diff = max(
                    (packed[a:b] - model(input_ids=ids[:, a:b]).logits[0]).abs().max().item()
                    for a, b in documents
                )
            results.append(f"{attention}: {'ok' if diff < 1e-5 else 'LEAKS'} ({diff:.0e})")
        print(f"{model_type:14s} " + "  ".join(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--architectures", action="store_true")
    args = parser.parse_args()
    if args.architectures:
        architectures()
    else:
        throughput(args.max_length, args.batch_size)


if __name__ == "__main__":
    main()
