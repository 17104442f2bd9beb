"""Run by ``fsdp2_factored.py`` (one launch for both) under ``accelerate launch`` with two CPU
processes (gloo); test_fsdp2_optim.py reads what it finds.

Checks, on real FSDP1 and FSDP2 from torch (Accelerate itself only enables FSDP on GPUs), what
effitrain's sharding rules say: FSDP2's DTensor parameters crash the libraries' Adafactors and
CAME (effitrain replaces them there: fsdp2_factored.py) and bitsandbytes, but not AdamW; FSDP1 hands the optimizer flattened 1-D shards, so Adafactor keeps a full
``variance``; FSDP1 with ``use_orig_params=False`` leaves an optimizer built before wrapping
holding parameters that never train. Each rank's facts go to ``$FSDP_FACTS_DIR/rank-<N>.json``
(not stdout: two ranks' lines can interleave in one pipe).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

warnings.filterwarnings("ignore")
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "adafactor-hf":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)
    if name == "adamw-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3)
    if name in ("lion", "lion-8bit", "came", "adamw-schedule-free"):
        from effitrain.optim import OPTIMIZERS, set_train_mode

        optimizer = OPTIMIZERS[name].factory([{"params": list(params)}], 1e-4)
        set_train_mode(optimizer, True)  # schedule-free steps only in train mode
        return optimizer
    return torch.optim.AdamW(params, lr=1e-3)


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def checksum(model: torch.nn.Module) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def fsdp2_outcome(name: str, mesh, errors: dict) -> str:
    model = make_model()
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(name, model.parameters())
    try:
        train_steps(model, optimizer)
    except RuntimeError as exc:
        errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
        return "crash"
    return "trains"


def adam_mini_facts(mesh) -> dict:
    """Adam-mini on the tiny DistilBERT (the same batch on every rank): FSDP2 against one
    unsharded process, and FSDP1's 1-D shards under an optimizer built before wrapping."""
    from effitrain.models import load_model, load_tokenizer
    from effitrain.optim import build_optimizer

    tokenizer = load_tokenizer("tiny")

    def make():
        torch.manual_seed(0)
        return load_model("tiny", ["a", "b"], tokenizer)

    torch.manual_seed(1)
    ids, labels = torch.randint(5, len(tokenizer), (4, 16)), torch.tensor([0, 1, 1, 0])

    def train(model, optimizer):
        for _ in range(3):
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    reference = make()
    train(reference, build_optimizer(reference, "adam-mini", 1e-3, 0.01))
    model = make()
    for layer in model.distilbert.transformer.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, build_optimizer(model, "adam-mini", 1e-3, 0.01))
    full = [p.full_tensor() for p in model.parameters()]
    facts = {
        "fsdp2_max_diff": max(
            float((a - b).abs().max()) for a, b in zip(full, reference.parameters(), strict=True)
        ),
        "fsdp2_moved": max(
            float((a - b).abs().max()) for a, b in zip(full, make().parameters(), strict=True)
        ),
    }
    model = make()
    optimizer = build_optimizer(model, "adam-mini", 1e-3, 0.01)  # before wrapping, as effitrain
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    try:
        train(wrapped, optimizer)
        facts["fsdp1"] = "trains"
    except IndexError:
        facts["fsdp1"] = "IndexError"
    return facts


def gather(state: PartialState, mesh) -> dict:
    """This rank's facts (``fsdp2_factored.py`` runs it in the same launch as its own)."""
    facts: dict = {"rank": state.process_index, "fsdp2": {}, "fsdp2_errors": {}, "fsdp1": {}}
    for name in (
        *("adamw", "adafactor", "adafactor-hf", "adamw-8bit"),
        *("lion", "lion-8bit", "came", "adamw-schedule-free"),
    ):
        facts["fsdp2"][name] = fsdp2_outcome(name, mesh, facts["fsdp2_errors"])

    wrapped = FullyShardedDataParallel(
        make_model(), device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer = make_optimizer("adafactor", wrapped.parameters())
    train_steps(wrapped, optimizer)
    facts["fsdp1"]["param_dims"] = sorted({p.dim() for p in wrapped.parameters()})
    facts["fsdp1"]["adafactor"] = sorted({k for s in optimizer.state.values() for k in s})
    wrapped = FullyShardedDataParallel(
        make_model(), device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer = make_optimizer("came", wrapped.parameters())
    train_steps(wrapped, optimizer)
    facts["fsdp1"]["came"] = sorted({k for s in optimizer.state.values() for k in s})

    model = make_model()
    optimizer = make_optimizer("adamw", model.parameters())  # built before wrapping, as effitrain
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=False)
    before = checksum(wrapped)
    train_steps(wrapped, optimizer)
    facts["fsdp1"]["orig_params_false_trains"] = checksum(wrapped) != before
    facts["adam-mini"] = adam_mini_facts(mesh)
    return facts


def write(file_name: str, facts: dict) -> None:
    """This rank's facts as ``$FSDP_FACTS_DIR/<file_name>``."""
    (Path(os.environ["FSDP_FACTS_DIR"]) / file_name).write_text(json.dumps(facts))
