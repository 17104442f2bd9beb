"""``--task causal-lm`` end to end through the CLI: the demo, instruction jsonl, text files, a
saved pretrained-style folder, exact resume, the memory table, refusals, estimate and LoRA."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.checkpoint_helpers import assert_identical, load_tensors
from tests.conftest import assert_clean_error

SHORT = ("--max-length", "32", "--batch-size", "4", "--log-every", "1")

INSTRUCTIONS = [
    {"instruction": f"Name the colour of item {i}.", "input": "", "output": f"Item {i} is blue."}
    for i in range(24)
]
PROMPTS = [
    {"prompt": f"Q: what is {i} plus one?\nA:", "completion": f" {i + 1}."} for i in range(24)
]
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"Say hello to number {i}."},
            {"role": "assistant", "content": f"Hello, number {i}!"},
        ]
    }
    for i in range(24)
]
TEXT = "\n\n".join(
    f"The river town of Amber {i} held a market on Monday. Farmers sold apples and bread there."
    for i in range(40)
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def metrics_of(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
def test_demo_defaults_run_a_few_steps_and_report_perplexity(train_cli, tmp_path):
    out = tmp_path / "m.json"
    proc = train_cli("train", "--task", "causal-lm", "--max-steps", "3", "--metrics-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny-llama" in proc.stdout and "LlamaForCausalLM" in proc.stdout
    assert "perplexity" in proc.stdout and "sample" in proc.stdout  # the demo's own prompt
    assert "tokens/s" in proc.stdout
    metrics = metrics_of(out)
    assert metrics["task"] == "causal-lm"
    assert metrics["config"]["model"] == "tiny-llama"
    ev = metrics["eval"]
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]), rel=1e-6)
    assert ev["tokens"] > 0 and "accuracy" not in ev
    assert isinstance(metrics["eval_history"][-1]["sample"], str)
    assert metrics["tokens_per_second"] > 0
    # The whole memory breakdown, as for classification.
    # exp_avg and exp_avg_sq in fp32, plus a 4-byte step per parameter tensor
    assert 0 < metrics["optimizer_state"]["bytes"] - 8 * metrics["trainable_parameters"] < 400
    assert metrics["gradient_bytes"] > 0 and metrics["activation_bytes"] > 0
    assert "optimizer state" in proc.stdout.lower()


def test_decoder_tasks_are_the_tasks_that_train_a_causal_lm():
    """config.DECODER_TASKS (the leaf's, read where the tasks cannot be imported) names exactly
    the tasks built on DecoderTask."""
    from effitrain.config import DECODER_TASKS
    from effitrain.tasks import TASKS
    from effitrain.tasks.causal_lm import DecoderTask

    decoders = {name for name, task in TASKS.items() if isinstance(task, DecoderTask)}
    assert set(DECODER_TASKS) == decoders


@pytest.mark.slow
def test_the_preset_alone_picks_the_task(train_cli):
    proc = train_cli("train", "--model", "tiny-llama", "--max-steps", "1", *SHORT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "perplexity" in proc.stdout


@pytest.mark.parametrize(
    "rows, fmt",
    [
        (INSTRUCTIONS, "instruction"),
        # Every format's detection and masks are unit tests in test_lm_data.py.
        pytest.param(PROMPTS, "prompt-completion", marks=pytest.mark.slow),
        pytest.param(CHATS, "messages", marks=pytest.mark.slow),
    ],
)
def test_instruction_jsonl_trains_on_completions_only(train_cli, tmp_path, rows, fmt):
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", "--task", "causal-lm", "--dataset", str(data), "--max-steps", "3",
        "--metrics-json", str(out), *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{fmt} data" in proc.stdout and "loss on completions only" in proc.stdout
    assert "padded" in proc.stdout  # instruction data is padded by default
    assert metrics_of(out)["eval"]["tokens"] > 0


def test_text_file_is_packed_and_learns(train_cli, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", "--task", "causal-lm", "--dataset", str(tmp_path / "corpus.txt"),
        "--epochs", "2", "--metrics-json", str(out), *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "text data in column text, packed" in proc.stdout
    history = metrics_of(out)["eval_history"]
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.slow
def test_padding_instead_of_packing(train_cli, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    proc = train_cli(
        "train", "--task", "causal-lm", "--dataset", str(tmp_path / "corpus.txt"),
        "--no-packing", "--max-steps", "2", *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "text data in column text, padded" in proc.stdout


@pytest.mark.slow
def test_pretrained_style_folder_is_fine_tuned_and_the_task_detected(
    train_cli, tmp_path, lm_model_dir
):
    data = write_jsonl(tmp_path / "train.jsonl", PROMPTS)
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", "--model", str(lm_model_dir), "--dataset", str(data), "--max-steps", "2",
        "--output-dir", str(tmp_path / "run"), "--metrics-json", str(out), *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fine-tuning" in proc.stdout  # the regime of a folder: fine-tuning defaults
    assert metrics_of(out)["task"] == "causal-lm"
    final = tmp_path / "run" / "final"
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final)  # a loadable causal LM


@pytest.mark.slow
def test_a_causal_lm_on_labelled_data_stays_a_classifier(train_cli, tmp_path, lm_model_dir):
    rows = [
        {"text": f"good thing {i}" if i % 2 else f"bad thing {i}", "label": i % 2}
        for i in range(20)
    ]
    data = write_jsonl(tmp_path / "labelled.jsonl", rows)
    proc = train_cli(
        "train", "--model", str(lm_model_dir), "--dataset", str(data), "--max-steps", "1", *SHORT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accuracy" in proc.stdout and "perplexity" not in proc.stdout


@pytest.mark.slow
def test_resume_is_bit_exact(train_cli, tmp_path):
    """With the chunked, token-weighted loss over two micro-batches per step (the defaults and
    --grad-accum 2): the resumed run groups the same micro-batches into the same steps."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    common = (
        "train", "--task", "causal-lm", "--dataset", str(tmp_path / "corpus.txt"),
        "--max-steps", "6", "--save-every", "3", "--sample-prompt", "", "--grad-accum", "2",
        *SHORT,
    )  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = train_cli(*common, "--output-dir", str(straight))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-3", resumed / "checkpoint-3")
    proc = train_cli(*common, "--output-dir", str(resumed), "--resume", "latest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout
    compared = assert_identical(
        load_tensors(straight / "checkpoint-6"), load_tensors(resumed / "checkpoint-6")
    )
    assert compared > 10
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))


def test_lora_and_gradient_checkpointing_on_a_causal_lm(train_cli, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", "--task", "causal-lm", "--dataset", str(tmp_path / "corpus.txt"),
        "--lora-rank", "4", "--gradient-checkpointing", "--max-steps", "2",
        "--metrics-json", str(out), *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = metrics_of(out)
    assert metrics["trainable_parameters"] < metrics["parameter_bytes"] / 4 / 10
    assert "head" not in next(line for line in proc.stdout.splitlines() if "LoRA r=4" in line)


@pytest.mark.slow
def test_estimate_a_causal_lm(train_cli):
    proc = train_cli("estimate", "--task", "causal-lm", "--optim", "adamw,adafactor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    rows = rows if isinstance(rows, list) else rows.get("rows", [rows])
    adamw = next(r for r in rows if r["optimizer"] == "adamw")
    assert 0 < adamw["optimizer_state"]["bytes"] - 8 * adamw["trainable_parameters"] < 400


@pytest.mark.parametrize(
    "options, fragments",
    [
        (("--task", "causal-lm", "--model", "tiny"), ("sequence-classification preset",)),
        (("--model", "tiny-llama", "--task", "sequence-classification"), ("causal-LM preset",)),
        (("--packing",), ("--packing needs --task causal-lm",)),
        (("--task", "causal-lm", "--text-columns", "a,b"), ("one",)),
        (("--task", "causal-lm", "--max-length", "1"), ("--max-length 1", "2 tokens")),
    ],
)
def test_option_refusals(train_cli, options, fragments):
    assert_clean_error(train_cli("train", *options), *fragments)


@pytest.mark.parametrize(
    "content, name, fragments",
    [
        ("", "empty.jsonl", ("empty",)),
        ('{"title": "a", "body": "b"}\n' * 5, "cols.jsonl", ("column", "title")),
        (
            (json.dumps({"prompt": "word " * 60, "completion": "answer"}) + "\n") * 10,
            "cut.jsonl",
            ("--max-length",),
        ),
    ],
)
def test_bad_data_gets_one_line(train_cli, tmp_path, content, name, fragments):
    (tmp_path / name).write_text(content)
    proc = train_cli("train", "--task", "causal-lm", "--dataset", str(tmp_path / name), *SHORT)
    assert_clean_error(proc, *fragments)


# Two processes under accelerate launch: tests/test_distributed.py
# (test_causal_lm_under_two_processes), in the one launch its DDP runs share.


def test_a_text_file_with_a_folder_causal_lm_is_detected_as_causal_lm(
    train_cli, tmp_path, lm_model_dir
):
    (tmp_path / "corpus.txt").write_text(TEXT)
    proc = train_cli(
        "train", "--model", str(lm_model_dir), "--dataset", str(tmp_path / "corpus.txt"),
        "--max-steps", "1", *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "perplexity" in proc.stdout and "packed" in proc.stdout
