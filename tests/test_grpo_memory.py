"""GRPO's memory in two phases (issue 47, item 3): ``effitrain estimate --task grpo`` runs the
run's own generation on fake tensors (every completion to its full length) and the training
step on its completions; each phase's peak is within 2 % of what a run measures, at two
completion lengths; ``estimate`` and ``plan`` refuse ``--beta`` > 0 in one line."""

from __future__ import annotations

import json

import pytest

PROMPT = "On Monday, the committee"
"""Every prompt alike: the run's batches are as long as the data's longest prompt, as the
estimate assumes."""


@pytest.mark.slow
@pytest.mark.parametrize("completion", [6, 24])
def test_estimate_equals_measured_per_phase(train_cli, tmp_path, completion):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": PROMPT}) for _ in range(12)))
    common = (
        *("--task", "grpo", "--model", "tiny-llama", "--train-file", str(prompts)),
        *("--batch-size", "4", "--num-generations", "2", "--seed", "1"),
        *("--max-completion-length", str(completion)),
    )
    metrics = tmp_path / "metrics.json"
    proc = train_cli(
        "train", *common, "--max-steps", "2", "--log-every", "1",
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


def test_estimate_and_plan_refuse_the_kl_penalty():
    from effitrain.config import TrainConfig
    from effitrain.errors import EffitrainError
    from effitrain.tasks.grpo import refuse_planning

    refuse_planning(TrainConfig(task="grpo"), "estimate")
    for command in ("estimate", "plan"):
        with pytest.raises(EffitrainError, match=f"effitrain {command} does not take --task grpo "):
            refuse_planning(TrainConfig(task="grpo", beta=0.1), command)
