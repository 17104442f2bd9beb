"""Which optimizer works with which sharding: effitrain's rules, and what two CPU processes show.

The table's verdicts (works, a note, refused) are what ``effitrain train`` decides:
``effitrain.distributed.optimizer_notes`` on a stand-in of Accelerate's state for each
sharding, at render time, so a changed rule makes this README and docs/distributed.md stale
(the suite checks both). The evidence next to them is measured: two processes over gloo with
torch's own FSDP1 and FSDP2 (Accelerate enables FSDP on GPUs only), run by the test suite's
scripts ``tests/fsdp_facts.py`` (which library optimizers crash on DTensors, what FSDP1's flat
shards do) and ``tests/fsdp2_factored.py`` (effitrain's factored optimizers on FSDP2 against one
process, each rank's state bytes, checkpoints).

    python -m benchmarks.sharding.run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import common

TOPIC = common.Topic.of(__file__)
SMOKE_ARGS: list[str] = []
DOCS = common.REPO / "docs" / "distributed.md"
DOCS_BEGIN = "<!-- sharding table: rendered by `python -m benchmarks.sharding.run --render` -->"
DOCS_END = "<!-- /sharding table -->"
TESTS = common.REPO / "tests"

SHARDINGS = {
    "DDP": SimpleNamespace(distributed_type="MULTI_GPU", num_processes=2),
    "FSDP1 (`use_orig_params: true`)": SimpleNamespace(
        distributed_type="FSDP",
        num_processes=2,
        fsdp_plugin=SimpleNamespace(fsdp_version=1, use_orig_params=True),
    ),
    "FSDP2": SimpleNamespace(
        distributed_type="FSDP",
        num_processes=2,
        fsdp_plugin=SimpleNamespace(fsdp_version=2, reshard_after_forward=True),
    ),
    **{
        f"DeepSpeed ZeRO-{stage}": SimpleNamespace(
            distributed_type="DEEPSPEED",
            num_processes=2,
            deepspeed_plugin=SimpleNamespace(zero_stage=stage, deepspeed_config={}),
        )
        for stage in (1, 2, 3)
    },
}
"""Stand-ins of Accelerate's state, as ``effitrain.distributed.detect_sharding`` reads it."""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: Path, out_dir: Path) -> None:
    """``script`` on two CPU processes over gloo; its JSON lands in ``out_dir``."""
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "FSDP_FACTS_DIR": str(out_dir),
        "PYTHONPATH": str(common.REPO),
    }
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"),
        *("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--main_process_port", str(free_port())),
        str(script),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: {script.name} failed:\n{proc.stderr[-3000:]}")


def bitsandbytes_on_shards() -> dict[str, float]:
    """Why bitsandbytes' 8-bit AdamW stays refused under FSDP2: run on each rank's rows (two
    row shards of a 301 x 100 weight, 5 steps, lr 1e-2) it differs from the whole tensor by as
    much as 8-bit differs from fp32 AdamW (its blocks of 256 values move with the shards)."""
    import logging

    import torch

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(301, 100, generator=generator)
    grads = [torch.randn(301, 100, generator=generator) for _ in range(5)]
    whole = torch.nn.Parameter(weight.clone())
    shards = [torch.nn.Parameter(rows.clone()) for rows in weight.chunk(2)]
    fp32 = torch.nn.Parameter(weight.clone())
    optimizers = [
        bnb.optim.AdamW8bit([whole], lr=1e-2),
        bnb.optim.AdamW8bit(shards, lr=1e-2),
        torch.optim.AdamW([fp32], lr=1e-2),
    ]
    for grad in grads:
        whole.grad, fp32.grad = grad.clone(), grad.clone()
        for shard, rows in zip(shards, grad.chunk(2), strict=True):
            shard.grad = rows.clone()
        for optimizer in optimizers:
            optimizer.step()
    joined = torch.cat([shard.detach() for shard in shards])
    return {
        "shards_vs_whole": float((joined - whole.detach()).abs().max()),
        "whole_vs_fp32_adamw": float((whole.detach() - fp32.detach()).abs().max()),
    }


def measure(args: argparse.Namespace, device: str) -> common.Run:
    from effitrain.optim import OPTIMIZERS

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        launch(TESTS / "fsdp2_factored.py", out)  # runs fsdp_facts.py's checks too
        launch(Path(__file__).with_name("step_time.py"), out)
        step_time = json.loads((out / "step-time.json").read_text())
        facts = json.loads((out / "rank-0.json").read_text())
        factored = [
            json.loads((out / f"factored-rank-{rank}.json").read_text())["optimizers"]
            for rank in (0, 1)
        ]
    rows = []
    for name in OPTIMIZERS:
        row: dict[str, Any] = {"optimizer": name}
        if name in facts["fsdp2"]:
            row["fsdp2_library"] = facts["fsdp2"][name]
            if name in facts["fsdp2_errors"]:
                row["fsdp2_library_error"] = facts["fsdp2_errors"][name]
        if name in factored[0]:
            ranks = [f[name] for f in factored]
            row["fsdp2_max_diff"] = max(max(f["param_max_diff_per_step"]) for f in ranks)
            row["fsdp2_rank_state_bytes"] = [f["rank_state_bytes"] for f in ranks]
            row["one_process_state_bytes"] = ranks[0]["one_process_state_bytes"]
            row["fsdp2_checkpoint_bit_identical"] = all(
                c["bit_identical"] for f in ranks for c in f["checkpoint"].values()
            )
        if name == "adam-mini":
            row["fsdp2_max_diff"] = facts["adam-mini"]["fsdp2_max_diff"]
            row["fsdp1"] = facts["adam-mini"]["fsdp1"]
        if name in facts["fsdp1"]:
            row["fsdp1_state_keys"] = facts["fsdp1"][name]
        rows.append(row)
    return {
        "name": args.name or "cpu-gloo",
        "title": "two CPU processes over gloo, torch's own FSDP1 and FSDP2",
        "settings": {"processes": 2, "steps": 4},
        "rows": rows,
        "bitsandbytes_on_shards": bitsandbytes_on_shards(),
        "step_time": step_time,
    }


# --------------------------------------------------------------------------------------------
# Rendering: the rules (now) and the evidence (results.json)
# --------------------------------------------------------------------------------------------


def verdict(state: Any, optim: str) -> tuple[str, str | None]:
    """``("works" | "note" | "refused", message)`` as ``effitrain train`` decides it, with the
    optimizer's name as ``<optim>`` and a ZeRO stage as ``ZeRO-N`` (one message for many cells)."""
    from effitrain.distributed import optimizer_notes
    from effitrain.errors import EffitrainError

    try:
        notes = optimizer_notes(state, optim)
    except EffitrainError as exc:
        kind, message = "refused", str(exc)
    else:
        kind, message = ("note", " ".join(notes)) if notes else ("works", "")
    message = re.sub(rf"(?<![\w-]){re.escape(optim)}(?![\w-])", "<optim>", message)
    return kind, re.sub(r"ZeRO-[123]", "ZeRO-N", message) or None


def _evidence(column: str, row: dict[str, Any]) -> str:
    if column == "FSDP2":
        if "fsdp2_max_diff" in row:
            text = f"2 processes = 1 (max diff {row['fsdp2_max_diff']:.1e})"
            if row.get("fsdp2_checkpoint_bit_identical"):
                text += ", resumes bit for bit"
            if row.get("fsdp2_library") == "crash":
                text += "; effitrain's sharded class (the library's crashes)"
            return text
        if row.get("fsdp2_library") == "trains":
            return "trains on 2 processes"
        if row.get("fsdp2_library") == "crash":
            return "crashes on 2 processes"
        return "not run"
    if column.startswith("FSDP1"):
        if "fsdp1_state_keys" in row:
            return "state on 2 processes: " + ", ".join(f"`{k}`" for k in row["fsdp1_state_keys"])
        if row.get("fsdp1"):
            return f"{row['fsdp1']} on 2 processes"
        return ""
    if column.startswith("DeepSpeed"):
        return "not run"
    return ""


def sharding_table(run: common.Run) -> str:
    """The optimizer x sharding table with numbered messages under it."""
    columns = ["DDP", "FSDP1 (`use_orig_params: true`)", "FSDP2", "DeepSpeed ZeRO-1/2/3"]
    messages: list[str] = []

    def cell(column: str, row: dict[str, Any]) -> str:
        states = (
            [SHARDINGS[f"DeepSpeed ZeRO-{s}"] for s in (1, 2, 3)]
            if column.startswith("DeepSpeed")
            else [SHARDINGS[column]]
        )
        outcomes = {verdict(state, row["optimizer"]) for state in states}
        if len(outcomes) != 1:
            raise ValueError(f"{row['optimizer']}: ZeRO stages differ: {sorted(outcomes)}")
        ((kind, message),) = outcomes
        text = {"works": "works", "note": "works, with a note", "refused": "**refused**"}[kind]
        if message:
            if message not in messages:
                messages.append(message)
            text += f" [{messages.index(message) + 1}]"
        evidence = _evidence(column, row)
        return f"{text}; {evidence}" if evidence else text

    lines = ["| optimizer | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in run["rows"]:
        cells = [cell(column, row) for column in columns]
        lines.append(f"| `{row['optimizer']}` | " + " | ".join(cells) + " |")
    notes = [f"{i}. {message}" for i, message in enumerate(messages, 1)]
    crashes = [
        f"- `{row['optimizer']}`: `{row['fsdp2_library_error']}`"
        for row in run["rows"]
        if row.get("fsdp2_library_error")
    ]
    if crashes:
        notes += ["", "How each library optimizer crashes on FSDP2's DTensor parameters:", ""]
        notes += crashes
    said = "The numbers: what `effitrain train` says, word for word (`<optim>`: the optimizer):"
    return "\n".join(lines) + f"\n\n{said}\n\n" + "\n".join(notes)


def bytes_table(run: common.Run) -> str:
    rows = [row for row in run["rows"] if "fsdp2_rank_state_bytes" in row]
    columns = [
        common.Column("optimizer", lambda r: f"`{r['optimizer']}`", right=False),
        common.Column("one process", lambda r: f"{r['one_process_state_bytes']:,} B"),
        common.Column("rank 0", lambda r: f"{r['fsdp2_rank_state_bytes'][0]:,} B"),
        common.Column("rank 1", lambda r: f"{r['fsdp2_rank_state_bytes'][1]:,} B"),
        common.Column("max diff vs one process", lambda r: f"{r['fsdp2_max_diff']:.1e}"),
        common.Column(
            "checkpoint (sharded and full)",
            lambda r: "bit for bit" if r["fsdp2_checkpoint_bit_identical"] else "differs",
        ),
    ]
    return common.markdown_table(columns, rows)


def step_time_table(run: common.Run) -> str:
    columns = [
        common.Column("optimizer", lambda r: f"`{r['optimizer']}`", right=False),
        common.Column("FSDP2, 2 processes", lambda r: f"{r['fsdp2_step_ms']:.1f} ms"),
        common.Column("1 process, the library", lambda r: f"{r['one_process_step_ms']:.1f} ms"),
    ]
    return (
        "\n\nThe optimizer step's time (median of 6 steps, one thread per process; 8 Linear "
        "layers of 1024 x 1024; under FSDP2 each rank steps half the rows, so the ideal is half "
        "the one-process time; CPU and gloo: indicative only):\n\n"
        + common.markdown_table(columns, run["step_time"])
    )


def render(run: common.Run) -> str:
    bnb = run.get("bitsandbytes_on_shards")
    why = (
        "\n\nbitsandbytes' 8-bit AdamW run on each rank's rows instead of the whole tensor (two "
        "row shards of a 301 x 100 weight, 5 steps, lr 1e-2, one process): max difference "
        f"{bnb['shards_vs_whole']:.1e}, as large as 8-bit's own difference from fp32 AdamW "
        f"({bnb['whole_vs_fp32_adamw']:.1e}); its blocks of 256 values move with the shard "
        "boundaries. Two processes could not equal one, so it stays refused under FSDP2."
        if bnb
        else ""
    )
    return (
        "Optimizer state under FSDP2, per rank (the ledger), on the test model of "
        "`tests/fsdp2_factored.py` (dim 0 sizes 11, 5, 3 and 1: uneven and empty shards), "
        "after 4 steps:\n\n"
        + bytes_table(run)
        + (step_time_table(run) if run.get("step_time") else "")
        + why
        + "\n\nEvery sharding:\n\n"
        + sharding_table(run)
    )


def docs_block(data: dict[str, Any]) -> str:
    (run,) = [r for r in data["runs"] if r["name"] == "cpu-gloo"]
    return f"{DOCS_BEGIN}\n{sharding_table(run)}\n{DOCS_END}"


def render_docs(check: bool) -> int:
    data = common.load_results(TOPIC.results, TOPIC)
    text = DOCS.read_text()
    start, stop = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if start < 0 or stop < start:
        print(f"{DOCS} has no sharding table block", file=sys.stderr)
        return 1
    new = text[:start] + docs_block(data) + text[stop + len(DOCS_END) :]
    if check:
        if new != text:
            print(f"{DOCS} is stale: python -m {TOPIC.module} --render", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(new)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(TOPIC, __doc__)
    args = parser.parse_args(argv)
    code = common.main(TOPIC, args, argv, measure, render)
    if code == 0 and (args.render or args.check or args.results == TOPIC.results):
        code = render_docs(check=args.check)
    return code


if __name__ == "__main__":
    sys.exit(main())
