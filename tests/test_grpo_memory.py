"""GRPO's memory in two phases (issue 47, item 3): ``effitrain estimate --task grpo`` runs the
run's own generation on fake tensors (every completion to its full length) and the training
step on its completions; each phase's peak is within 2 % of what a run measures, at two
completion lengths, and with ``--beta`` > 0 (the reference a frozen copy, or the adapters off);
``plan`` keeps each prompt's group in one micro-batch and names the peak's phase."""

from __future__ import annotations

import json

import pytest

PROMPT = "On Monday, the committee"
"""Every prompt alike: the run's batches are as long as the data's longest prompt, as the
estimate assumes."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("completion", "options"),
    [
        (6, ()),
        (24, ()),
        (12, ("--beta", "0.04")),  # the reference: a frozen copy
        (12, ("--beta", "0.04", "--lora-rank", "4")),  # the adapters off
        # Each generation trained on twice: the old log-probs made while generating; the
        # step measured (the third) one that generates, as the estimate's.
        (6, ("--num-iterations", "2")),
    ],
)
def test_estimate_equals_measured_per_phase(train_cli, tmp_path, completion, options):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": PROMPT}) for _ in range(12)))
    common = (
        *("--task", "grpo", "--model", "tiny-llama", "--train-file", str(prompts)),
        *("--batch-size", "4", "--num-generations", "2", "--seed", "1"),
        *("--max-completion-length", str(completion)),
        *options,
    )
    metrics = tmp_path / "metrics.json"
    steps = "3" if "--num-iterations" in options else "2"
    proc = train_cli(
        "train", *common, "--max-steps", steps, "--log-every", "1",
        "--output-dir", str(tmp_path / "run"), "--metrics-json", str(metrics),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    measured = json.loads(metrics.read_text())
    # No completion of the measured step ended early (the seed's): the estimate's worst case.
    assert measured["loss_history"][-1]["completions/mean_length"] == completion
    proc = train_cli("estimate", *common, "--compare-to", str(metrics), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    errors = result["errors"]
    for key in ("generation_peak_bytes", "training_peak_bytes", "peak_tensor_bytes"):
        assert abs(errors[key]) < 0.02, (key, errors)
    assert result["estimates"][0]["peak_phase"] == measured["peak_phase"]


def test_plan_screens_each_phase_at_larger_micro_batches():
    """The generation phase holds the weights and state but no gradients; each phase grows
    with the micro-batch on its own, and the peak can change phase as it grows."""
    from effitrain.plan_screens import Screen, extend

    one = Screen(70, 40, 10, 20, 1, None, phases=(70, 65))  # static: 20 + 10 gradients + 10
    assert (one.peak_at(1), one.peak_phase(1)) == (70, "training")
    assert (one.peak_at(3), one.peak_phase(3)) == (30 + 3 * 35, "generation")
    assert Screen(70, 40, 10, 20, 1, None).peak_phase(3) is None
    two = Screen(140, 80, 20, 40, 2, None, phases=(140, 130))
    assert extend(one, two, 4).phases == (280, 260)


def test_plan_lists_no_lever_the_task_refuses():
    """GRPO's loss never chunks: the plan does not name the chunked loss among its levers (a
    causal LM's plan does: it is on by default there)."""
    from effitrain.config import build_config
    from effitrain.distributed import Launch
    from effitrain.planning import _Search

    def reasons(task: str, **options: object) -> dict[str, str]:
        config = build_config(None, {"task": task, "model": "tiny-llama", **options})
        launch = Launch.described(1, "ddp", "cpu")
        return _Search(config, launch, 2**30, ["adamw"], [], {}, task=task)._reasons({})

    assert "chunked-loss" in reasons("causal-lm")
    assert "chunked-loss" not in reasons("grpo", batch_size=4, num_generations=2)


def test_a_config_json_alone_notes_the_prompts_and_completions(tmp_path):
    """Without a tokenizer, the estimate's note says the batch it runs: N prompts of P tokens,
    G completions each of C tokens."""
    from effitrain.build import checked_config
    from effitrain.estimation import _tokenizer_or_config
    from effitrain.tasks.grpo import GrpoTask

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    options = {"task": "grpo", "model": str(tmp_path), "batch_size": 4, "num_generations": 2}
    config = checked_config(None, {**options, "max_length": 8, "max_completion_length": 3})
    notes: list[str] = []
    assert _tokenizer_or_config(config, notes, GrpoTask())[0] is None
    assert "the batch is 2 prompts of 8 token ids, 2 completions each of 3 tokens" in notes[0]


def test_without_a_tokenizer_the_prompts_are_max_length_long_the_default_included():
    """The config cannot tell ``--max-length 128`` typed from the default 128: without a
    tokenizer to measure the prompts with, either is the prompts' length (and the note says
    it), not a demand to give the option that was given."""
    from effitrain.config import build_config
    from effitrain.tasks.grpo import GrpoTask

    options = {"task": "grpo", "batch_size": 4, "num_generations": 2}
    for typed in ({}, {"max_length": 128}):
        config = build_config(None, {**options, **typed})
        assert GrpoTask().estimate_shape(config, None, None, 128) == (2, 128)


@pytest.mark.slow
def test_plan_splits_the_batch_into_whole_groups_and_names_the_peak_phase(train_cli):
    """Every split the plan lists, verified or only screened, keeps each prompt's 4 completions
    in one micro-batch (8 x 1 and 4 x 2, never 2 x 4 or 1 x 8) and the global batch of 8, and
    names its peak's phase. One lever set and one optimizer (the splits are what is searched):
    a plan of one screen per split."""
    from tests.test_plan import NO_LEVERS

    proc = train_cli(
        "plan", "--task", "grpo", "--model", "tiny-llama", "--memory", "64MiB",
        "--batch-size", "8", "--num-generations", "4", "--max-length", "8",
        "--max-completion-length", "8", "--optim", "adamw", "--full-parameter",
        "--without", NO_LEVERS, "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    listed = result["candidates"] + result["not_verified"]
    assert result["candidates"]
    assert {(c["batch_size"], c["grad_accum"]) for c in listed} == {(8, 1), (4, 2)}, listed
    assert {c["peak_phase"] for c in listed} <= {"generation", "training"}
