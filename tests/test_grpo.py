"""GRPO (``--task grpo``): the loss and its gradients equal TRL 1.16's ``GRPOTrainer._compute_loss``
for each loss type on the same completions, masks and advantages, with and without the KL to a
reference (``--beta``, and TRL's ``kl`` metric); the log-probs equal TRL's
``selective_log_softmax`` of the logits over the temperature; advantages as TRL normalises
them; reward functions called as TRL calls them, with one-line errors; a tiny run end to end,
its metrics by TRL's names, and an exact resume (with a frozen copy as the reference too); the
reference through the adapters switched off.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from effitrain.tasks.grpo_loss import (
    GrpoLoss,
    GrpoSettings,
    completion_logps,
    group_advantages,
    nanstd,
)
from effitrain.tasks.grpo_rewards import RewardFunction, load_reward, score
from effitrain.tasks.lm_loss import step_scale
from tests.checkpoint_helpers import assert_identical, load_tensors


@pytest.fixture(scope="module")
def trl():
    """TRL's GRPO trainer and helpers, imported once, where a test needs them (seconds)."""
    pytest.importorskip("trl")
    from trl.trainer import utils
    from trl.trainer.grpo_trainer import GRPOTrainer

    return SimpleNamespace(
        GRPOTrainer=GRPOTrainer,
        selective_log_softmax=utils.selective_log_softmax,
        nanstd=utils.nanstd,
    )


def _settings(loss_type: str, length: int = 6, beta: float = 0.0) -> GrpoSettings:
    return GrpoSettings(4, length, 0.7, 1.0, loss_type, "group", 0.2, 0.28, (1.0,), beta)


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).float()


def _batch() -> dict[str, torch.Tensor]:
    """Four left-padded prompts of 3 tokens and right-padded completions up to 5 tokens."""
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, 50, (4, 3), generator=generator)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    completion_ids = torch.randint(4, 50, (4, 5), generator=generator)
    completion_mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "input_ids": torch.cat([prompt_ids, completion_ids], 1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], 1),
        "labels": torch.cat(
            [
                torch.full_like(prompt_ids, -100),
                completion_ids.masked_fill(completion_mask == 0, -100),
            ],
            1,
        ),
        "advantages": torch.tensor([1.3, -0.4, 0.2, -1.1]),
    }


def _trl_trainer(settings: GrpoSettings, model: torch.nn.Module) -> SimpleNamespace:
    """The attributes TRL's ``_compute_loss`` reads, for one process and no accumulation; its
    log-probs are effitrain's (compared with TRL's own separately)."""
    accelerator = SimpleNamespace(
        num_processes=1,
        reduce=lambda t, reduction: t,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
    )
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, input_ids, attention_mask, width, **_: (
            completion_logps(
                model,
                {
                    "input_ids": input_ids,
                    "attention_mask": attention_mask,
                    "completion_ids": input_ids[:, -width:],
                },
                settings.temperature,
            ),
            torch.zeros(input_ids.shape[0], width),
            None,
        ),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=settings.beta,
        loss_type=settings.loss_type,
        epsilon_low=settings.epsilon_low,
        epsilon_high=settings.epsilon_high,
        args=args,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=model,
        current_gradient_accumulation_steps=1,
        max_completion_length=settings.max_completion_length,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        _metrics={"train": __import__("collections").defaultdict(list)},
    )


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-reference", "beta-0.04"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_and_gradients_equal_trl(loss_type, beta, trl):
    """GrpoLoss's step (with beta > 0 its reference a frozen copy of another model, through
    the reference lever's provider) against TRL's ``_compute_loss``, given the same reference
    log-probs; TRL's ``kl`` metric too."""
    from effitrain.config import TrainConfig
    from effitrain.tasks.reference_model import FrozenCopy

    settings, model, batch = _settings(loss_type, beta=beta), _tiny_model(), _batch()
    trl_inputs = {
        k: batch[k]
        for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    }
    trl_inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    loss = GrpoLoss(settings, [], seed=0)
    if beta:
        loss.reference = FrozenCopy(_tiny_model(seed=1), loss, TrainConfig(task="grpo"))
        with torch.no_grad():
            trl_inputs["ref_per_token_logps"] = completion_logps(
                _tiny_model(seed=1), batch, settings.temperature
            )
    trainer = _trl_trainer(settings, model)
    theirs = trl.GRPOTrainer._compute_loss(trainer, model, trl_inputs)
    their_grads = torch.autograd.grad(theirs, list(model.parameters()))

    ours = loss(model, batch)
    if loss_type == "dapo":  # a sum, weighed by the step's tokens as the loop weighs it
        ours = ours * step_scale(
            [batch], SimpleNamespace(num_processes=1, gradient_accumulation_steps=1)
        )
    our_grads = torch.autograd.grad(ours, list(model.parameters()))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in our_grads)
    metrics = loss.window_metrics(SimpleNamespace(num_processes=1))
    if beta:
        assert metrics["kl"] == pytest.approx(trainer._metrics["train"]["kl"][0], rel=1e-6)
        assert metrics["kl"] > 1e-3  # another model: its term is far above the tolerances
    else:
        assert "kl" not in metrics and "kl" not in trainer._metrics["train"]


def test_loss_and_clip_ratios_equal_trl_with_old_log_probs(trl):
    """``--num-iterations`` > 1: the old log-probs (the policy's at generation) differ from the
    current ones, so the ratio moves and is clipped on both sides; loss, gradients and TRL's
    ``clip_ratio/*`` metrics equal TRL's (dapo, its default)."""
    settings, model, batch = _settings("dapo"), _tiny_model(), _batch()
    with torch.no_grad():
        current = completion_logps(model, batch, settings.temperature)
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(2))
    batch["old_logps"] = current + 0.3 * noise
    trl_inputs = {
        k: batch[k]
        for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    }
    trl_inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    trl_inputs["old_per_token_logps"] = batch["old_logps"]
    trainer = _trl_trainer(settings, model)
    theirs = trl.GRPOTrainer._compute_loss(trainer, model, trl_inputs)
    their_grads = torch.autograd.grad(theirs, list(model.parameters()))

    loss = GrpoLoss(settings, [], seed=0)
    ours = loss(model, batch) * step_scale(
        [batch], SimpleNamespace(num_processes=1, gradient_accumulation_steps=1)
    )
    our_grads = torch.autograd.grad(ours, list(model.parameters()))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    metrics = loss.window_metrics(SimpleNamespace(num_processes=1))
    for name in ("low", "high", "region"):
        key = f"clip_ratio/{name}_mean"
        assert metrics[key] == pytest.approx(trainer._metrics["train"][key][0], abs=1e-7), key
        assert metrics[key] > 0, key  # clipped on both sides


def test_log_probs_equal_trl_on_the_logits_over_the_temperature(trl):
    model, batch = _tiny_model(), _batch()
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = trl.selective_log_softmax(
            logits[:, -width - 1 : -1], batch["completion_ids"], temperature=0.7
        )
        ours = completion_logps(model, batch, 0.7)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_advantages_as_trl(trl):
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 1.0], [0.5, 1.0]])
    weights = torch.tensor([1.0, 2.0])
    # Weighted: [1, 0, 2.5, 2.5]; group 1 mean 0.5, std 0.7071; group 2 has no spread.
    group = group_advantages(rewards, weights, 2, "group")
    torch.testing.assert_close(
        group,
        torch.tensor([0.5, -0.5, 0.0, 0.0])
        / torch.tensor([0.70711 + 1e-4, 0.70711 + 1e-4, 1e-4, 1e-4]),
        rtol=1e-4,
        atol=1e-6,
    )
    none = group_advantages(rewards, weights, 2, "none")
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    batch = group_advantages(rewards, weights, 2, "batch")
    std = float(torch.tensor([1.0, 0.0, 2.5, 2.5]).std())
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (std + 1e-4))
    # A completion every function refused (None) is out of its group's mean, advantage 0.
    refused = torch.tensor([[1.0], [math.nan], [0.0], [2.0]])
    torch.testing.assert_close(
        group_advantages(refused, torch.tensor([1.0]), 2, "none"),
        torch.tensor([0.0, 0.0, -1.0, 1.0]),
    )
    values = torch.tensor([[1.0, math.nan, 3.0], [2.0, 2.0, math.nan]])
    torch.testing.assert_close(nanstd(values, dim=1), trl.nanstd(values, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(values), trl.nanstd(values))


def test_reward_functions_called_as_trl(tmp_path):
    file = tmp_path / "rewards.py"
    file.write_text(
        "def by_answer(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    return [None if a == 'skip' else float(c == a) + len(i) for c, a, i in zip(completions, answer, completion_ids)]\n"
        "def broken(completions, **kwargs):\n"
        "    return [1.0]\n"
        "def wrong_type(completions, **kwargs):\n"
        "    return 'good'\n"
        "def raises(completions, **kwargs):\n"
        "    raise ValueError('no answer column')\n"
    )
    reward = load_reward(f"{file}:by_answer")
    rows = [{"prompt": "p", "answer": "x"}, {"prompt": "q", "answer": "skip"}]
    table = score([reward], rows, ["p", "q"], ["x", "y"], [[1, 2], [3]])
    assert table.shape == (2, 1) and table[0, 0] == 3.0 and math.isnan(table[1, 0])
    from effitrain.errors import EffitrainError

    for spec, fragment in (
        (f"{file}:missing", "has no function 'missing'"),
        (f"{tmp_path}/none.py:f", "no such file"),
        ("rewards:f", "expected FILE.py:FUNCTION"),
    ):
        with pytest.raises(EffitrainError, match=fragment):
            load_reward(spec)
    for name, fragment in (
        ("broken", "returned 1 rewards"),
        ("wrong_type", "returned str"),
        ("raises", "raised ValueError: no answer column"),
    ):
        with pytest.raises(EffitrainError, match=fragment):
            score([load_reward(f"{file}:{name}")], rows, ["p", "q"], ["x", "y"], [[1], [2]])
    assert RewardFunction  # the type the task holds


def test_refusals(train_cli):
    cli = train_cli
    from tests.conftest import assert_clean_error

    for args, fragment in (
        (["--beta", "-0.1"], "--beta must be 0 or more under --task grpo"),
        (["--reference", "copy"], "--reference needs --beta above 0 under --task grpo"),
        (["--reference-dtype", "bf16"], "--reference-dtype needs --beta above 0"),
        (["--beta", "0.04", "--reference", "precompute"], "cannot serve --task grpo"),
        (["--beta", "0.04", "--reference", "adapters"], "or use --reference copy"),
        (
            ["--beta", "0.04", "--lora-rank", "4", "--reference", "copy"],
            "use --reference adapters",
        ),
        (
            ["--batch-size", "6", "--num-generations", "4"],
            "must be a multiple of --num-generations",
        ),
        (["--packing"], "--packing does not apply to --task grpo"),
        (["--chunked-loss", "torch"], "--chunked-loss needs --task causal-lm or preference"),
        (["--reward", "x.txt"], "expected FILE.py:FUNCTION"),
        (["--num-iterations", "0"], "--num-iterations must be 1 or more"),
    ):
        assert_clean_error(cli("train", "--task", "grpo", *args), fragment)
    assert_clean_error(
        cli("train", "--task", "causal-lm", "--num-generations", "4"),
        "--num-generations needs --task grpo",
    )


GRPO_RUN = (
    "--task",
    "grpo",
    "--batch-size",
    "4",
    "--num-generations",
    "2",
    "--max-completion-length",
    "4",
    "--log-every",
    "1",
)


@pytest.mark.parametrize(
    "reference",
    [(), pytest.param(("--beta", "0.04"), marks=pytest.mark.slow)],
    ids=["no-reference", "copy"],
)
def test_train_logs_trl_names_and_resumes_exactly(train_cli, tmp_path, reference):
    """Each generation serves 2 optimizer steps (``--num-iterations 2``): a straight run saving
    every step, and a run resumed from its step-1 checkpoint, between the two steps of the
    first generation (its completions and old log-probs kept), end with the same weights,
    reward history and logged metrics; generation is seeded from its number. With --beta > 0
    (a full fine-tune: a frozen copy), the same KL at step 3: the resumed run's reference is
    the model as the run started, not as it was resumed."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = (*GRPO_RUN, *reference, "--max-steps", "3", "--save-every", "1",
              "--num-iterations", "2", "--lr", "1e-2", "--warmup-steps", "0")  # fmt: skip
    proc = train_cli(
        "train", *common, "--output-dir", str(straight), "--metrics-json", str(tmp_path / "a.json")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (
        "reward",
        "reward_std",
        "rewards/letter_share/mean",
        "completions/mean_length",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    ):
        assert f" {name} " in proc.stdout, name
    assert (" kl " in proc.stdout) == bool(reference)
    # Between the two steps of a generation, its completions are kept; after them, not.
    assert (straight / "checkpoint-1" / "grpo_buffer.rank0.safetensors").exists()
    assert not list((straight / "checkpoint-2").glob("grpo_buffer*"))
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    proc = train_cli(
        "train",
        *common,
        "--output-dir",
        str(resumed),
        "--metrics-json",
        str(tmp_path / "b.json"),
        "--resume",
        "latest",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b"))
    # Two generations for three steps: one per two steps.
    assert len(a["reward_history"]) == 2 and a["reward_history"] == b["reward_history"]
    assert a["loss_history"][-1]["reward"] == a["reward_history"][-1]
    assert "reward" not in a["loss_history"][1]  # step 2 reused step 1's completions
    assert a["loss_history"][1]["clip_ratio/region_mean"] > 0  # their ratio moved
    assert a["loss_history"][1:] == b["loss_history"][1:]
    # The step measured is one that generates (step 3: the second generation), both phases.
    assert a["generation_peak_bytes"] > 0 and a["peak_phase"] in ("generation", "training")
    # The evaluation's sample is shown with its reward, one of the rewards it averages.
    assert re.search(r"  sample    '.+ -> .*'  reward \d\.\d{3}\n", proc.stdout)
    assert 0 <= a["eval"]["sample_reward"] <= 1 and a["eval"] == b["eval"]
    assert_identical(load_tensors(straight / "final"), load_tensors(resumed / "final"))
    if reference:
        kl = [entry["kl"] for entry in a["loss_history"]]
        assert kl[0] == 0.0 and kl[2] > 0 and b["loss_history"][-1]["kl"] == kl[2]
        assert a["reference"] == {"how": "copy", "dtype": "fp32", "bytes": a["parameter_bytes"]}
        return
    # Saved by 2 processes (say): each kept its own completions; one process cannot go on.
    state = json.loads((straight / "checkpoint-1" / "grpo_state.json").read_text())
    (straight / "checkpoint-1" / "grpo_state.json").write_text(json.dumps(state | {"processes": 2}))
    proc = train_cli(
        "train", *common, "--output-dir", str(tmp_path / "other"), "--resume",
        str(straight / "checkpoint-1"),
    )  # fmt: skip
    from tests.conftest import assert_clean_error

    assert_clean_error(proc, "saved 1 of --num-iterations 2 steps into a generation")


def test_kl_to_the_adapters_off_reference(train_cli, tmp_path):
    """--beta with LoRA: the reference is the base with the adapters switched off (0 bytes, its
    own row); the KL is 0 before the first update, then above 0, in the log line and the
    metrics JSON by TRL's name."""
    out = tmp_path / "m.json"
    proc = train_cli(
        "train", *GRPO_RUN, "--max-steps", "2", "--beta", "0.04", "--lora-rank", "4",
        "--warmup-steps", "0", "--metrics-json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference: the base with the adapters switched off" in proc.stdout
    assert "+ reference: adapters switched off" in proc.stdout and " kl " in proc.stdout
    metrics = json.loads(out.read_text())
    assert metrics["reference"] == {"how": "adapters", "dtype": None, "bytes": 0}
    assert metrics["loss"]["beta"] == 0.04
    kl = [entry["kl"] for entry in metrics["loss_history"]]
    assert kl[0] == 0.0 and kl[1] > 0


def test_prompts_strings_or_chats_with_their_columns(tmp_path):
    from effitrain.config import TrainConfig
    from effitrain.demo.lm import build_lm_tokenizer
    from effitrain.errors import EffitrainError
    from effitrain.tasks.grpo_data import load_prompt_data, prompt_texts

    chats = tmp_path / "chats.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"Say {n}"}], "answer": str(n)} for n in range(10)
    ]
    chats.write_text("\n".join(json.dumps(r) for r in rows))
    data = load_prompt_data(TrainConfig(task="grpo", train_file=str(chats)))
    assert data.conversational and "answer" in data.train.column_names
    text = prompt_texts([rows[0]["prompt"]], build_lm_tokenizer())[0]
    assert text.startswith("<|im_start|>user\nSay 0") and text.endswith("<|im_start|>assistant\n")
    assert prompt_texts(["plain"], build_lm_tokenizer()) == ["plain"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}))
    with pytest.raises(EffitrainError, match="no 'prompt' column"):
        load_prompt_data(TrainConfig(task="grpo", train_file=str(bad)))
