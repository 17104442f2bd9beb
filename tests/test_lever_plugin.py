"""A lever is one module: a toy lever, defined here and registered with one call
(``effitrain.levers.register``), is an option of ``train --help``, a YAML key, a lever of
``effitrain estimate`` and of the plan's search, and part of the resume command a stopped run
prints, with no other file changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import OFFLINE

TOY_LEVER = """
from dataclasses import dataclass

from effitrain.config import MEMORY_LEVERS, OptionGroup, option_field
from effitrain.levers import register
from effitrain.levers.spec import Lever, Search


@dataclass
class ToyOptions(OptionGroup):
    toy_checkpointing: bool = option_field(
        False, "Checkpoint every layer (a toy lever).", panel=MEMORY_LEVERS
    )


class ToyCheckpointing(Lever):
    name = "toy-checkpointing"
    options = ToyOptions
    removes = "most activations (a toy)"
    search = Search((False, True), order=5, costs_time=False)

    def is_on(self, config):
        return ToyOptions.of(config).toy_checkpointing

    def apply_to_model(self, model, config, device):
        from effitrain.levers.gradient_checkpointing import enable

        enable(model)
        return model

    def banner(self, config, model):
        return "toy checkpointing"


register(ToyCheckpointing())
"""

SCRIPT = """
import json, sys
from typer.testing import CliRunner

TOY_LEVER

# As the suite's conftest does: the plan's verifier processes (spawned where the machine looks
# slow) would each pay this process's imports again; the toy lever is searched the same in one.
import effitrain.plan_workers
effitrain.plan_workers.PARALLEL_FROM_SECONDS = float("inf")

from effitrain.checkpoint import resume_command
from effitrain.cli import app
from effitrain.config import build_config

out = {}
for name, args in json.loads(sys.argv[1]).items():
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    out[name] = {"code": result.exit_code, "stdout": result.stdout}
config = build_config(overrides={"toy_checkpointing": True, "output_dir": "out"})
out["resume"] = resume_command(config, 1)
print(json.dumps(out))
"""


def _with_toy_lever(commands: dict[str, list[str]], cwd) -> dict:
    script = SCRIPT.replace("TOY_LEVER", TOY_LEVER)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), json.dumps(commands)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **OFFLINE},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # a new process: a short run, an estimate and a plan
def test_a_lever_defined_outside_effitrain_is_everywhere_a_lever_is(tmp_path):
    # The tiny preset: the default distilbert-base shape cost seconds per step on a CPU.
    (tmp_path / "toy.yaml").write_text("toy_checkpointing: true\nmax_steps: 2\nmodel: tiny\n")
    metrics = tmp_path / "metrics.json"
    out = _with_toy_lever(
        {
            "help": ["train", "--help"],
            "yaml": [
                "train",
                "--config",
                "toy.yaml",
                "--no-memory-breakdown",
                "--metrics-json",
                str(metrics),
            ],
            "estimate": ["estimate", "--model", "tiny", "--toy-checkpointing"],
            # Declared as costing no time, it is tried even where smaller micro-batches fit (at
            # 128 tokens in 64 MiB the 16-row micro-batch needs a lever, 8 rows fit without).
            # Two built-in levers left out: a search of half the candidates, the toy's in it.
            "plan": [
                "plan",
                *("--task", "causal-lm", "--max-length", "128", "--memory", "64MiB"),
                *("--optim", "adamw", "--full-parameter", "--json"),
                *("--without", "optimizer-in-backward,bf16-weights"),
            ],
        },
        cwd=tmp_path,
    )
    assert "--toy-checkpointing" in out["help"]["stdout"]
    assert out["yaml"]["code"] == 0, out["yaml"]["stdout"]
    assert "toy checkpointing" in out["yaml"]["stdout"]  # its banner line
    assert "toy-checkpointing" in json.loads(metrics.read_text())["levers"]
    assert out["estimate"]["code"] == 0, out["estimate"]["stdout"]
    assert "adamw + toy-checkpointing" in out["estimate"]["stdout"]
    assert "--toy-checkpointing" in out["resume"].split()
    plan = json.loads(out["plan"]["stdout"])
    planned = [
        c for c in plan["candidates"] + plan["not_verified"] if "toy-checkpointing" in c["levers"]
    ]
    assert planned and all("--toy-checkpointing" in c["args"] for c in planned), plan
