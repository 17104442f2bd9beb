"""LoRA and QLoRA under Accelerate's real FSDP2, two CPU processes over gloo, in one launch
(:mod:`tests.launch_runs`): each equals one process, a stopped-and-resumed run equals the
uninterrupted one, only the main process reads the checkpoint where the launch can send the
others its weights (:mod:`tests.read_spy`), and ``estimate`` says what rank 0 holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.launch_runs import launch_runs
from tests.test_distributed import REPO

pytest.importorskip("peft")

pytestmark = pytest.mark.slow

# Global batch 4: two processes x 2, or one process x 4. No dropout, so that they can agree.
COMMON = (
    "--task", "causal-lm", "--lora-rank", "4", "--lora-dropout", "0", "--max-length", "64",
    "--lr", "1e-2", "--max-steps", "4", "--log-every", "1", "--seed", "3",
)  # fmt: skip
ADAM_ATOL = 1e-4
"""How far one process's trained values may be from two processes': AdamW divides each
gradient by its own size, so where a gradient is near zero the fp32 rounding of a split batch's
mean moves that element by up to a fraction of ``--lr`` (measured: one element of 1,152 at
2.6e-5 after 4 steps, the rest within 1e-6)."""
RUNS = {
    "lora": ("--save-every", "2", "--lora-merge"),
    "lora-resumed": ("--save-every", "2", "--lora-merge", "--resume", "latest"),
    "qlora": ("--load-in-4bit", "--save-every", "2"),
    "qlora-resumed": ("--load-in-4bit", "--save-every", "2", "--resume", "latest"),
    "qlora-other-base": ("--load-in-4bit", "--save-every", "2", "--resume", "latest"),
}
"""The runs of the one launch, in order, by name."""
RESUMES = {"lora-resumed": "lora", "qlora-resumed": "qlora", "qlora-other-base": "qlora"}
"""The runs that restart from another's step-2 checkpoint (``qlora-other-base``: with a base
model one of whose weights differs, which the resume must refuse)."""


def run_args(model: Path, out: Path, name: str, batch_size: int) -> list[str]:
    return ["train", "--quiet", "--model", str(model), *COMMON, *RUNS[name],
            "--batch-size", str(batch_size), "--output-dir", str(out / name),
            "--metrics-json", str(out / f"{name}.json")]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory, lm_model_dir):
    """The runs in two FSDP2 processes: the shipped ``fsdp2-full-shard.yaml`` (rank 0 reads,
    the others start on the meta device) with the tiny Llama's block class to wrap."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("fsdp2-lora")
    config = out / "fsdp2.yaml"
    shipped = (REPO / "configs" / "accelerate" / "fsdp2-full-shard.yaml").read_text()
    config.write_text(
        shipped.replace("cls_to_wrap: TransformerBlock", "cls_to_wrap: LlamaDecoderLayer")
    )
    other = out / "other-base"
    shutil.copytree(lm_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] += 0.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    runs = []
    for name in RUNS:
        model = other if name == "qlora-other-base" else lm_model_dir
        entry = {"name": name, "args": run_args(model, out, name, 2)}
        if name in RESUMES:
            straight = out / RESUMES[name] / "checkpoint-2"
            entry["copy"] = [str(straight), str(out / name / "checkpoint-2")]
        runs.append(entry)
    launched = launch_runs(out, runs, config=config, timeout=400)
    launched.assert_ran("qlora-other-base", (1, 1))  # every process refuses
    for name in RUNS:
        if name != "qlora-other-base":
            launched.assert_ran(name)
    return SimpleNamespace(
        out=out,
        model=lm_model_dir,
        metrics={
            name: json.loads((out / f"{name}.json").read_text())
            for name in RUNS
            if name != "qlora-other-base"
        },
        refusal_output=launched.stdout("qlora-other-base") + launched.stderr("qlora-other-base"),
    )


def one_process(runs, name: str, tmp_path: Path) -> dict:
    """``name`` in this one process, with the global batch in one batch: its metrics."""
    from tests.conftest import train_in_process

    proc = train_in_process(*run_args(runs.model, tmp_path, name, 4))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())


def losses(metrics: dict) -> list[float]:
    return [entry["loss"] for entry in metrics["loss_history"]]


def adapters(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def assert_close(a: dict, b: dict) -> None:
    """Equal within :data:`ADAM_ATOL`, and all but a few elements (under 0.5 %) within 1e-6."""
    assert a.keys() == b.keys() and a
    total = far = 0
    for key in a:
        difference = (a[key].double() - b[key].double()).abs()
        assert float(difference.max()) <= ADAM_ATOL, key
        far += int((difference > 1e-6).sum())
        total += difference.numel()
    assert far * 200 <= total, (far, total)


def test_lora_under_fsdp2_equals_one_process(fsdp2_runs, tmp_path):
    import torch

    from tests.read_spy import reads
    from tests.test_distributed import load_parameters

    two = fsdp2_runs.metrics["lora"]
    assert two["sharding"]["kind"] == "fsdp2" and two["num_processes"] == 2
    # Rank 1 started on the meta device and opened no file of the model: Accelerate filled its
    # shards from rank 0's.
    assert [r["weights"] for r in two["ranks"]] == ["read", "from rank 0"]
    model_file = str(fsdp2_runs.model / "model.safetensors")
    assert reads(fsdp2_runs.out, 0, "lora") == [model_file]
    assert reads(fsdp2_runs.out, 1, "lora") == []
    # Sharded: each rank holds its own half, not a copy.
    checksums = [r["parameter_checksum"] for r in two["ranks"]]
    assert checksums[0] != checksums[1]

    one = one_process(fsdp2_runs, "lora", tmp_path)
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert losses(one)[-1] < losses(one)[0]
    trained = adapters(fsdp2_runs.out / "lora" / "final")
    assert_close(trained, adapters(tmp_path / "lora" / "final"))
    assert max(float(t.abs().max()) for k, t in trained.items() if "lora_B" in k) > 1e-2
    # --lora-merge gathers the sharded base and adapters into one plain model.
    # (The gathered state dict has lost the tie: the head is written too, equal to the
    # embedding it is tied to again on loading.)
    merged = load_parameters(fsdp2_runs.out / "lora" / "final-merged")
    assert torch.equal(merged.pop("lm_head.weight"), merged["model.embed_tokens.weight"])
    assert_close(merged, load_parameters(tmp_path / "lora" / "final-merged"))


def test_lora_under_fsdp2_resumes_exactly(fsdp2_runs):
    from tests.checkpoint_helpers import assert_identical

    straight, resumed = fsdp2_runs.metrics["lora"], fsdp2_runs.metrics["lora-resumed"]
    assert resumed["global_steps"] == 4
    assert len(losses(straight)) == 4 and losses(resumed) == losses(straight)
    assert [r["parameter_checksum"] for r in resumed["ranks"]] == [
        r["parameter_checksum"] for r in straight["ranks"]
    ]
    out = fsdp2_runs.out
    assert_identical(adapters(out / "lora" / "final"), adapters(out / "lora-resumed" / "final"))


def test_qlora_under_fsdp2_equals_one_process_and_resumes_exactly(fsdp2_runs, tmp_path):
    from tests.checkpoint_helpers import assert_identical
    from tests.read_spy import reads

    two = fsdp2_runs.metrics["qlora"]
    # Every process reads and quantizes: bitsandbytes' quant state is no parameter or buffer
    # that the launch could send.
    assert [r["weights"] for r in two["ranks"]] == ["read", "read"]
    model_file = str(fsdp2_runs.model / "model.safetensors")
    assert reads(fsdp2_runs.out, 1, "qlora") == [model_file]

    one = one_process(fsdp2_runs, "qlora", tmp_path)
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    assert_close(
        adapters(fsdp2_runs.out / "qlora" / "final"), adapters(tmp_path / "qlora" / "final")
    )
    # Each rank holds half of the packed codes (stored as bf16 so that FSDP2 shards them) and
    # the whole quant state.
    rank0, rank1 = (r["parameter_bytes"] for r in two["ranks"])
    assert rank0 == rank1 < one["ranks"][0]["parameter_bytes"]

    resumed = fsdp2_runs.metrics["qlora-resumed"]
    assert [r["parameter_checksum"] for r in resumed["ranks"]] == [
        r["parameter_checksum"] for r in two["ranks"]
    ]
    out = fsdp2_runs.out
    assert_identical(adapters(out / "qlora" / "final"), adapters(out / "qlora-resumed" / "final"))
    # Each rank compares its shard of the sharded checkpoint's 4-bit codes with the ones it
    # quantized: another base is refused in one line, by every process.
    refusal = "layers.0.self_attn.q_proj.base_layer.weight differs from the one quantized"
    errors = [line for line in fsdp2_runs.refusal_output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and refusal in errors[0], errors


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_estimate_says_what_rank_0_holds(fsdp2_runs, name):
    """``estimate --num-processes 2 --sharding fsdp`` gives rank 0's measured parameters (the
    frozen base and the adapters split by rows; the 4-bit quant state whole) and optimizer
    state, to the byte."""
    from effitrain.cli.compare import train_config
    from effitrain.distributed import Launch
    from effitrain.estimation import estimate

    args = run_args(fsdp2_runs.model, fsdp2_runs.out / "estimate", name, 2)[2:]
    config = train_config([a for a in args if a not in ("--resume", "latest")])
    per_rank = estimate(config, Launch.described(2, "fsdp", "cpu")).per_device
    rank0 = fsdp2_runs.metrics[name]["ranks"][0]
    assert per_rank.parameter_bytes == rank0["parameter_bytes"]
    assert per_rank.optimizer_state_bytes == rank0["optimizer_state_bytes"]
