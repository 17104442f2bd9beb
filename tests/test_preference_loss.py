"""The preference losses (effitrain.tasks.preference_loss): DPO, ORPO and SimPO equal TRL's
trainers' losses (and gradients) on the same model and batch; the chunked per-sequence log-probs
equal the full-logits ones; the rewards by TRL's names, in the window and the log line."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from effitrain.config import TrainConfig

IGNORE = -100
PAIRS = {
    "prompt": ["The cat sat on", "Two plus two is", "Hello there"],
    "chosen": [" the mat.", " four.", " friend, how are you?"],
    "rejected": [" a dog which barked loudly", " five", " go away"],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny-llama preset saved to a folder (TRL's DPOTrainer loads its reference from the
    model's path) and its tokenizer."""
    from effitrain.models import load_causal_lm, load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-pref")
    tokenizer = load_tokenizer("tiny-llama")
    load_causal_lm("tiny-llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return SimpleNamespace(folder=folder, tokenizer=tokenizer)


def _model(tiny_llama, perturb: bool = False):
    """The saved model in fp32; ``perturb``: its weights moved off the saved ones, so that it
    differs from a reference loaded from the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama.folder, dtype=torch.float32)
    if perturb:
        _perturb(model)
    return model.train()


def _perturb(model, seed: int = 3) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


def _config(loss: str, **options) -> TrainConfig:
    return TrainConfig(task="preference", preference_loss=loss, **options)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict(PAIRS)


class FrozenCopy:
    """A reference provider over a frozen model: its per-sequence sums, full logits."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)

    def logps(self, model, batch):
        import torch

        from effitrain.tasks.lm_loss import Choice
        from effitrain.tasks.preference_loss import sequence_logps

        with torch.no_grad():
            return sequence_logps(Choice("off"), self.model, self.model, batch)


def _grads(model) -> dict:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(mine: dict, theirs: dict) -> None:
    import torch

    assert mine.keys() == theirs.keys() and mine
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], msg=name)


# --- DPO ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_trl(tiny_llama, tmp_path_factory):
    """TRL's DPOTrainer on tiny-llama (its reference: the saved model), the policy moved off the
    reference after the trainer was built, TRL's own collated batch, its loss and gradients."""
    import torch
    from trl import DPOConfig, DPOTrainer

    model = _model(tiny_llama)
    args = DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("dpo")),
        report_to="none",
        per_device_train_batch_size=3,
        beta=0.1,
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 autocast: compare in fp32
    )
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=_dataset(), processing_class=tiny_llama.tokenizer
    )
    _perturb(trainer.model)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)
    ours = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
        "example": torch.arange(len(labels) // 2),
    }
    return SimpleNamespace(
        loss=loss.detach(), grads=_grads(trainer.model), batch=ours, metrics=trainer._metrics
    )


@pytest.mark.parametrize("chunked", ["off", "torch"])
def test_dpo_loss_and_gradients_equal_trl(tiny_llama, dpo_trl, chunked):
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama, perturb=True)
    loss = PreferenceLoss(_config("dpo"), Choice(chunked), model)
    loss.reference = FrozenCopy(_model(tiny_llama))
    value = loss(model, dpo_trl.batch)
    value.backward()
    assert abs(float(dpo_trl.loss) - 0.6931) > 1e-3  # the policy is not the reference
    torch.testing.assert_close(value, dpo_trl.loss)
    _assert_same_grads(_grads(model), dpo_trl.grads)


def test_dpo_differs_from_trl_with_a_shifted_mask_or_another_reference(tiny_llama, dpo_trl):
    """The comparison above can fail: one token's shift of the answer mask, or the policy as
    its own reference, change the loss."""
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama, perturb=True)
    loss = PreferenceLoss(_config("dpo"), Choice("off"), model)
    loss.reference = FrozenCopy(_model(tiny_llama))
    labels = dpo_trl.batch["labels"]
    shifted = {**dpo_trl.batch, "labels": labels.roll(1, dims=1)}
    assert abs(float(loss(model, shifted)) - float(dpo_trl.loss)) > 1e-4
    loss.reference = FrozenCopy(_model(tiny_llama, perturb=True))  # the policy itself
    assert abs(float(loss(model, dpo_trl.batch)) - float(dpo_trl.loss)) > 1e-4


def test_dpo_rewards_equal_trls_logged_metrics(tiny_llama, dpo_trl):
    """The window's means over one micro-batch are TRL's logged values for it."""
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import METRICS, PreferenceLoss

    model = _model(tiny_llama, perturb=True)
    loss = PreferenceLoss(_config("dpo"), Choice("torch"), model)
    loss.reference = FrozenCopy(_model(tiny_llama))
    loss(model, dpo_trl.batch)
    metrics = loss.window_metrics(_accelerator())
    assert tuple(metrics) == METRICS
    for name in METRICS:
        assert metrics[name] == pytest.approx(
            dpo_trl.metrics["train"][name][-1], rel=1e-5, abs=1e-5
        ), name
    assert loss.window_metrics(_accelerator()) == {}  # emptied


def test_label_smoothing_is_the_conservative_form(tiny_llama, dpo_trl):
    import torch
    import torch.nn.functional as F

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama, perturb=True)
    loss = PreferenceLoss(_config("dpo", label_smoothing=0.2), Choice("off"), model)
    loss.reference = FrozenCopy(_model(tiny_llama))
    with torch.no_grad():
        terms = loss.terms(model, dpo_trl.batch)
        d = terms.chosen_rewards - terms.rejected_rewards  # beta * the log-ratio difference
        expected = (-0.8 * F.logsigmoid(d) - 0.2 * F.logsigmoid(-d)).mean()
        torch.testing.assert_close(terms.loss(), expected)


# --- ORPO and SimPO -----------------------------------------------------------------------------


def _trl_pairwise(tiny_llama, tmp_path, kind: str):
    """TRL's ORPOTrainer or CPOTrainer (simpo, cpo_alpha 0) on the perturbed model: its loss
    and gradients on its own collated batch, and that batch as a contract batch."""
    import torch

    common = {
        "output_dir": str(tmp_path),
        "report_to": "none",
        "per_device_train_batch_size": 3,
        "use_cpu": True,
        "bf16": False,  # TRL's configs default to bf16 autocast: compare in fp32
    }
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config, trainer_class = ORPOConfig(beta=0.1, **common), ORPOTrainer
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5, **common)
        trainer_class = CPOTrainer
    model = _model(tiny_llama, perturb=True)
    trainer = trainer_class(
        model=model, args=config, train_dataset=_dataset(), processing_class=tiny_llama.tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    pad = trainer.padding_value if kind == "orpo" else trainer.pad_token_id
    joined = trainer.concatenated_inputs(batch, padding_value=pad)
    ours = {
        "input_ids": joined["concatenated_input_ids"],
        "attention_mask": joined["concatenated_attention_mask"],
        "labels": joined["concatenated_labels"],
        "example": torch.arange(len(joined["concatenated_labels"]) // 2),
    }
    return SimpleNamespace(
        loss=loss.detach(), grads=_grads(trainer.model), batch=ours, metrics=metrics
    )


@pytest.mark.parametrize("kind", ["orpo", "simpo"])
def test_orpo_and_simpo_equal_trl(tiny_llama, tmp_path, kind):
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import METRICS, PreferenceLoss

    trl = _trl_pairwise(tiny_llama, tmp_path, kind)
    for chunked in ("off", "torch"):
        model = _model(tiny_llama, perturb=True)
        loss = PreferenceLoss(_config(kind), Choice(chunked), model)
        value = loss(model, trl.batch)
        value.backward()
        torch.testing.assert_close(value, trl.loss)
        _assert_same_grads(_grads(model), trl.grads)
        metrics = loss.window_metrics(_accelerator())
        for name in METRICS:
            assert metrics[name] == pytest.approx(trl.metrics[name], rel=1e-5, abs=1e-5), (
                chunked,
                name,
            )


def test_orpo_nll_counts_the_prompt_as_trl_does(tiny_llama):
    """TRL's ORPO NLL is a token mean over the chosen rows' prompt and answer tokens."""
    import torch
    import torch.nn.functional as F

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama, perturb=True)
    batch = _contract_batch(tiny_llama.tokenizer)
    loss = PreferenceLoss(_config("orpo"), Choice("torch"), model)
    with torch.no_grad():
        terms = loss.terms(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        every = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        nll = F.cross_entropy(
            logits[:2, :-1].reshape(-1, logits.shape[-1]), every[:2, 1:].reshape(-1)
        )
        torch.testing.assert_close(terms.loss(), nll + terms.pair_losses.mean())


# --- chunked == off -----------------------------------------------------------------------------


def _contract_batch(tokenizer):
    """Two pairs of the first prompts, tokenized here as the contract says: chosen rows first,
    right-padded, labels on the answers only."""
    import torch

    rows = []
    for answers in (PAIRS["chosen"][:2], PAIRS["rejected"][:2]):
        for prompt, answer in zip(PAIRS["prompt"][:2], answers, strict=True):
            prompt_ids = tokenizer(prompt)["input_ids"]
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            rows.append((prompt_ids + answer_ids, len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows) + 2
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, IGNORE)
    for i, (ids, prompt_length) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, prompt_length : len(ids)] = input_ids[i, prompt_length : len(ids)]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "example": torch.arange(2),
    }


@pytest.mark.parametrize("average", [False, True])
def test_chunked_logps_and_gradients_equal_full_logits(tiny_llama, monkeypatch, average):
    import torch

    from effitrain.tasks import lm_loss
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import sequence_logps

    monkeypatch.setattr(lm_loss, "MIN_CHUNK_VALUES", 4096)  # several chunks of a tiny batch
    batch = _contract_batch(tiny_llama.tokenizer)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])  # each row's own gradient weight
    results = []
    for name in ("off", "torch"):
        model = _model(tiny_llama, perturb=True)
        logps = sequence_logps(Choice(name), model, model, batch, average=average)
        (logps * weights).sum().backward()
        results.append((logps.detach(), _grads(model)))
    (off, off_grads), (chunked, chunked_grads) = results
    assert off.shape == (4,) and off.dtype == torch.float32 and bool((off < 0).all())
    torch.testing.assert_close(chunked, off)
    _assert_same_grads(chunked_grads, off_grads)


def test_logps_are_the_answer_tokens_log_probs(tiny_llama):
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import sequence_logps

    model = _model(tiny_llama, perturb=True)
    batch = _contract_batch(tiny_llama.tokenizer)
    with torch.no_grad():
        logps = sequence_logps(Choice("off"), model, model, batch)
        log_probs = model(input_ids=batch["input_ids"]).logits.log_softmax(-1)
    for row in range(4):
        answer = (batch["labels"][row] != IGNORE).nonzero().flatten().tolist()
        expected = sum(float(log_probs[row, t - 1, batch["input_ids"][row, t]]) for t in answer)
        assert float(logps[row]) == pytest.approx(expected, abs=1e-4)


# --- metrics and the log line -------------------------------------------------------------------


def _accelerator():
    import torch

    return SimpleNamespace(num_processes=1, device=torch.device("cpu"))


class Fixed:
    """A reference whose log-probs are given."""

    def __init__(self, values):
        self.values = values

    def logps(self, model, batch):
        return self.values


def test_window_metrics_average_over_the_windows_pairs(tiny_llama):
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss, sequence_logps

    model = _model(tiny_llama)
    batch = _contract_batch(tiny_llama.tokenizer)
    with torch.no_grad():
        logps = sequence_logps(Choice("off"), model, model, batch)
    # Reference chosen below the policy on pair 0 only; rejected equal to the policy.
    reference = logps.clone()
    reference[0] -= 5.0
    reference[1] += 5.0
    loss = PreferenceLoss(_config("dpo", beta=0.5), Choice("torch"), model)
    loss.reference = Fixed(reference)
    loss(model, batch)
    loss(model, batch)  # a second micro-batch in the same window: same means
    metrics = loss.window_metrics(_accelerator())
    assert metrics["rewards/chosen"] == pytest.approx(0.0, abs=1e-4)  # (+2.5 - 2.5) / 2
    assert metrics["rewards/rejected"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["rewards/accuracies"] == pytest.approx(0.5)
    assert metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["logps/chosen"] == pytest.approx(float(logps[:2].mean()), abs=1e-4)
    assert metrics["logps/rejected"] == pytest.approx(float(logps[2:].mean()), abs=1e-4)


def test_defaults_and_description():
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    betas = {
        kind: PreferenceLoss(_config(kind), Choice("off"), None).beta
        for kind in ("dpo", "orpo", "simpo")
    }
    assert betas == {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}
    loss = PreferenceLoss(_config("simpo", beta=2.5), Choice("torch"), None)
    assert loss.token_weighted is False and loss.chunked
    assert loss.to_dict()["beta"] == 2.5 and loss.to_dict()["preference_loss"] == "simpo"
    assert "SimPO" in " ".join(loss.describe())


def test_log_line_and_eval_line_show_reward_accuracy():
    from rich.console import Console

    from effitrain.report.live import Reporter
    from effitrain.results import StepLog

    console = Console(file=io.StringIO(), width=200, highlight=False)
    reporter = Reporter(console=console)
    metrics = {"rewards/accuracies": 0.625, "rewards/margins": 0.041}
    reporter.logged(StepLog(1, 4, 1, 0.69, 1e-5, 10.0, 3.0, metrics=metrics))
    reporter.evaluated(1, {"loss": 0.6, "pairs": 8, **metrics})
    reporter.logged(StepLog(2, 4, 1, 0.69, 1e-5, 10.0, 3.0))
    lines = console.file.getvalue().splitlines()
    assert "loss 0.6900 · reward acc 0.625 · margin +0.041 · lr" in lines[0]
    assert "eval (epoch 1) · loss 0.6000 · reward acc 0.625 · margin +0.041" in lines[1]
    assert "reward" not in lines[2]


def test_preference_samples_are_pairs():
    import torch

    from effitrain.loop import batch_examples

    rows = torch.zeros(6, 5, dtype=torch.long)
    assert batch_examples({"labels": rows, "example": torch.arange(3)}) == 3
    assert batch_examples({"labels": rows}) == 6


def test_evaluate_preference_counts_each_pair_once(tiny_llama):
    """Over two batches: the loss is the mean over all pairs, the accuracy over all pairs."""
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss, evaluate_preference

    model = _model(tiny_llama).eval()
    batch = _contract_batch(tiny_llama.tokenizer)
    loss = PreferenceLoss(_config("simpo"), Choice("torch"), model)
    single = {k: (v[[0, 2]] if k != "example" else v[:1]) for k, v in batch.items()}
    accelerator = SimpleNamespace(gather_for_metrics=lambda t: t, **vars(_accelerator()))
    run = SimpleNamespace(
        model=model, accelerator=accelerator, loss=loss, eval_loader=[batch, single]
    )
    metrics = evaluate_preference(run)
    with torch.no_grad():
        both, one = loss.terms(model, batch), loss.terms(model, single)
    losses = torch.cat([both.pair_losses, one.pair_losses])
    assert metrics["pairs"] == 3
    assert metrics["loss"] == pytest.approx(float(losses.mean()), abs=1e-5)
    accurate = torch.cat(
        [both.chosen_rewards > both.rejected_rewards, one.chosen_rewards > one.rejected_rewards]
    )
    assert metrics["rewards/accuracies"] == pytest.approx(float(accurate.float().mean()))
    assert loss.window_metrics(_accelerator()) == {}  # evaluation leaves the window alone


def test_log_line_carries_the_rewards_to_the_history_and_trackers(tiny_llama):
    """loop.log_line: the window's rewards in the StepLog, the loss history (the metrics JSON)
    and the trackers' values; a loss without window metrics adds nothing."""
    import torch

    from effitrain.config import TrainConfig as Config
    from effitrain.loop import log_line
    from effitrain.progress import Stopwatch, TrainingProgress
    from effitrain.tasks.base import ModelLoss
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss
    from effitrain.tracking import Trackers

    model = _model(tiny_llama)
    batch = _contract_batch(tiny_llama.tokenizer)
    loss = PreferenceLoss(_config("simpo"), Choice("torch"), model)
    logged = []
    accelerator = SimpleNamespace(
        log=lambda values, step: logged.append(values), **vars(_accelerator())
    )
    trackers = Trackers(accelerator, Config(report_to=["tensorboard"]))
    run = SimpleNamespace(
        plan=SimpleNamespace(total_steps=4),
        lr_scheduler=SimpleNamespace(get_last_lr=lambda: [1e-5]),
        config=SimpleNamespace(log_every=1),
        trackers=trackers,
        loss=loss,
        accelerator=accelerator,
    )
    progress = TrainingProgress()
    value = loss(model, batch)
    progress.add_micro_batch(value.detach(), 2, torch.tensor(10))
    progress.step_done()
    log = log_line(run, progress, Stopwatch())
    assert log.metrics["rewards/accuracies"] in (0.0, 0.5, 1.0)
    assert progress.loss_history[-1] == {"step": 1, "loss": log.loss, **log.metrics}
    assert logged[-1]["train/rewards/margins"] == log.metrics["rewards/margins"]
    run.loss = ModelLoss()
    assert log_line(run, progress, Stopwatch()).metrics == {}
    assert set(progress.loss_history[-1]) == {"step", "loss"}


def test_kernel_path_sums_each_row_and_mask_apart(tiny_llama, monkeypatch):
    """cce gives one loss sum per call: the per-row calls (here a plain-torch stand-in with
    cce's signature, on the CPU) give the same log-probs and ORPO loss as full logits."""
    import torch
    import torch.nn.functional as F

    from effitrain.tasks import lm_loss
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss, sequence_logps

    calls = []

    def cce(flat, weight, targets, ignore_index, softcap, reduction):
        calls.append(len(flat))
        logits = F.linear(flat, weight).float()
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(lm_loss, "_kernel", lambda name: cce)
    batch = _contract_batch(tiny_llama.tokenizer)
    results = []
    for name in ("off", "cce"):
        model = _model(tiny_llama, perturb=True)
        logps = sequence_logps(Choice(name), model, model, batch, average=True)
        orpo = PreferenceLoss(_config("orpo"), Choice(name), model)(model, batch)
        (logps.sum() + orpo).backward()
        results.append((logps.detach(), orpo.detach(), _grads(model)))
    (logps, orpo, grads), (kernel_logps, kernel_orpo, kernel_grads) = results
    assert calls == [batch["input_ids"].shape[1]] * (4 + 4 + 2)  # per row and mask
    torch.testing.assert_close(kernel_logps, logps)
    torch.testing.assert_close(kernel_orpo, orpo)
    _assert_same_grads(kernel_grads, grads)


def test_liger_gives_way_to_torch_where_the_output_weight_trains(tiny_llama):
    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama)
    loss = PreferenceLoss(_config("simpo"), Choice("liger"), model)
    assert loss.name == "torch" and "liger-kernel would keep" in loss.describe()[0]
    model.get_output_embeddings().weight.requires_grad_(False)  # LoRA: the head is frozen
    assert PreferenceLoss(_config("simpo"), Choice("liger"), model).name == "liger"


def test_window_metrics_sum_over_processes_before_dividing(tiny_llama):
    """Under several processes the window's sums (pairs included) are all-reduced once, then
    divided: a pair-weighted mean over every process's pairs."""
    import torch

    from effitrain.tasks.lm_loss import Choice
    from effitrain.tasks.preference_loss import PreferenceLoss

    model = _model(tiny_llama)
    batch = _contract_batch(tiny_llama.tokenizer)
    loss = PreferenceLoss(_config("simpo"), Choice("off"), model)
    with torch.no_grad():
        loss(model, batch)
    single = loss.window_metrics(_accelerator())
    with torch.no_grad():
        loss(model, batch)
    reduced = []

    def reduce(tensor, how):  # another process with the same window
        reduced.append(how)
        return tensor * 2

    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=reduce)
    assert loss.window_metrics(two) == pytest.approx(single) and reduced == ["sum"]
