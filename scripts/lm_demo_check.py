"""Does the causal-LM demo learn visibly in under a minute? A plain torch loop, no effitrain loop.

Does what ``effitrain train --task causal-lm`` will do with its defaults: the tiny-llama preset
(random init) on the built-in corpus, documents packed into ``--max-length`` blocks (joined with
eos, position ids restarting at each document so attention stays inside it, the first token of
each document not predicted), batch 16, AdamW lr 1e-3 with weight decay 0.01 on >=2-D weights,
6% linear warmup then linear decay, grad-norm clip 1.0. Prints the untrained validation
perplexity, then per epoch the wall time, token-weighted validation loss and perplexity, and a
greedy 40-token continuation of DEMO_SAMPLE_PROMPT. The total includes building the corpus and
training the tokenizer.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python scripts/lm_demo_check.py [--threads 1]

The other options override the demo's settings, to try alternatives.
"""

from __future__ import annotations

import argparse
import math
import time


def pack(texts, tokenizer, block):
    """Blocks of ``block`` tokens: input_ids, position_ids and labels (LongTensors)."""
    import torch

    ids, pos, labels = [], [], []
    for text in texts:
        doc = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += doc
        pos += range(len(doc))
        labels += [-100] + doc[1:]  # the first token of a document follows nothing of it
    n = len(ids) // block * block
    blocks = [torch.tensor(x[:n]).view(-1, block) for x in (ids, pos, labels)]
    # a document cut by a block boundary restarts its positions at the block's start
    first = blocks[1][:, 0].clone()
    starts = blocks[1] - first[:, None]
    cut = torch.cumsum(blocks[1] == 0, dim=1) == 0  # tokens before the block's first doc start
    blocks[1] = torch.where(cut, starts, blocks[1])
    blocks[2][:, 0] = -100
    return blocks


def evaluate(model, blocks, batch_size):
    import torch

    ids, pos, labels = blocks
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(ids), batch_size):
            lab = labels[i : i + batch_size]
            out = model(input_ids=ids[i : i + batch_size], position_ids=pos[i : i + batch_size],
                        labels=lab, use_cache=False)  # fmt: skip
            n = int((lab[:, 1:] != -100).sum())
            total += out.loss.item() * n
            count += n
    model.train()
    loss = total / count
    return loss, math.exp(loss)


def sample(model, tokenizer, prompt, tokens=40):
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model.train()
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a 1-core run)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-train", type=int, default=None, help="corpus train documents")
    parser.add_argument("--vocab", type=int, default=None, help="BPE target vocabulary size")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.perf_counter()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

    from effitrain.demo import lm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.num_train is not None:
        lm.DEFAULT_NUM_TRAIN = args.num_train
    if args.vocab is not None:
        lm._BPE_VOCAB_SIZE = args.vocab
    settings = lm._TINY_LLAMA_SETTINGS
    if args.hidden is not None:
        settings["hidden_size"], settings["intermediate_size"] = args.hidden, 3 * args.hidden
    if args.layers is not None:
        settings["num_hidden_layers"] = args.layers
    imported = time.perf_counter()

    corpus = lm.build_demo_corpus(num_train=lm.DEFAULT_NUM_TRAIN)
    tokenizer = lm.build_lm_tokenizer()
    config = lm.tiny_llama_config()
    ready = time.perf_counter()
    model = LlamaForCausalLM(LlamaConfig(**config))
    train = pack(corpus["train"]["text"], tokenizer, args.max_length)
    validation = pack(corpus["validation"]["text"], tokenizer, args.max_length)
    n_train_tokens = sum(len(tokenizer(t)["input_ids"]) + 1 for t in corpus["train"]["text"])
    print(
        f"imports {imported - start:.1f}s; corpus+tokenizer {ready - imported:.1f}s; "
        f"vocab {len(tokenizer)}; params {sum(p.numel() for p in model.parameters()):,}; "
        f"train {len(corpus['train'])} docs {n_train_tokens:,} tokens {len(train[0])} blocks; "
        f"validation {len(corpus['validation'])} docs {len(validation[0])} blocks"
    )
    loss, ppl = evaluate(model, validation, 2 * args.batch_size)
    print(f"untrained: val loss {loss:.3f} ppl {ppl:.1f}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    steps_per_epoch = math.ceil(len(train[0]) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(
        optimizer, math.ceil(0.06 * total_steps), total_steps
    )
    print(f"{steps_per_epoch} steps/epoch, {total_steps} steps")
    generator = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(train[0]), generator=generator)
        for i in range(0, len(order), args.batch_size):
            idx = order[i : i + args.batch_size]
            out = model(input_ids=train[0][idx], position_ids=train[1][idx], labels=train[2][idx],
                        use_cache=False)  # fmt: skip
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        t1 = time.perf_counter()
        loss, ppl = evaluate(model, validation, 2 * args.batch_size)
        text = sample(model, tokenizer, lm.DEMO_SAMPLE_PROMPT)
        print(
            f"epoch {epoch + 1}: train {t1 - t0:.1f}s eval+sample {time.perf_counter() - t1:.1f}s "
            f"(total {time.perf_counter() - start:.1f}s) val loss {loss:.3f} ppl {ppl:.2f}"
        )
        print(f"  {lm.DEMO_SAMPLE_PROMPT!r} -> {text!r}")
    print(
        f"total {time.perf_counter() - start:.1f}s ({time.perf_counter() - imported:.1f}s after imports)"
    )


if __name__ == "__main__":
    main()
