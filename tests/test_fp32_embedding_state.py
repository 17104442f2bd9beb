"""--fp32-embedding-state: bitsandbytes' 8-bit optimizers keep 32-bit state for embedding
weights, exactly as ``Trainer.create_optimizer`` does, and nothing leaks into a later build."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint_helpers import train_args
from tests.conftest import assert_clean_error

pytest.importorskip("bitsandbytes")


def _tiny_model():
    from effitrain.models import load_model, load_tokenizer

    torch.manual_seed(0)
    return load_model("tiny", ["no", "yes"], load_tokenizer("tiny"))


def _step(model, optimizer):
    batch = torch.randint(0, model.config.vocab_size, (4, 16))
    model(input_ids=batch, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_dtypes(model, optimizer) -> dict[str, torch.dtype]:
    return {name: optimizer.state[p]["state1"].dtype for name, p in model.named_parameters()}


@pytest.fixture
def fresh_bnb_manager():
    """The Trainer registers its overrides in bitsandbytes' process-wide manager, by module and
    then by (group, index) position, where any later 8-bit optimizer would find them: reset it."""
    from bitsandbytes.optim import GlobalOptimManager

    yield
    GlobalOptimManager.get_instance().initialize()


def test_embeddings_keep_32bit_state_as_the_trainers_optimizer_does(tmp_path, fresh_bnb_manager):
    from transformers import Trainer, TrainingArguments

    from effitrain import optimizer_memory
    from effitrain.optim import build_optimizer, embedding_weights

    ours_model = _tiny_model()
    ours = build_optimizer(ours_model, "adamw-8bit", 1e-3, 0.01, fp32_embedding_state=True)
    _step(ours_model, ours)
    ours_dtypes = _state_dtypes(ours_model, ours)

    trainer_model = _tiny_model()
    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_bnb_8bit", report_to=[])
    trainer = Trainer(model=trainer_model, args=args)
    theirs = trainer.create_optimizer()
    _step(trainer_model, theirs)
    assert _state_dtypes(trainer_model, theirs) == ours_dtypes

    embeddings = {id(p) for p in embedding_weights(ours_model)}
    assert len(embeddings) == 2  # word and position embeddings
    for name, p in ours_model.named_parameters():
        if id(p) in embeddings:
            assert ours_dtypes[name] == torch.float32, name
        elif p.numel() >= 4096:
            assert ours_dtypes[name] == torch.uint8, name
    # Counted by the ledger to the byte, equal to the Trainer's.
    assert optimizer_memory(ours).bytes == optimizer_memory(theirs).bytes
    assert "embedding weights" in ours.split_description


def test_a_later_build_without_the_option_is_8bit_again():
    from bitsandbytes.optim import GlobalOptimManager

    from effitrain.optim import build_optimizer, embedding_weights

    first = _tiny_model()
    build_optimizer(first, "adamw-8bit", 1e-3, 0.01, fp32_embedding_state=True)
    ids = {id(p) for p in embedding_weights(first)}
    assert ids <= set(GlobalOptimManager.get_instance().pid2config)

    second = _tiny_model()
    optimizer = build_optimizer(second, "lion-8bit", 1e-4, 0.01)
    assert not ids & set(GlobalOptimManager.get_instance().pid2config)
    _step(second, optimizer)
    for p in embedding_weights(second):
        assert optimizer.state[p]["state1"].dtype == torch.uint8


def test_refused_for_an_optimizer_without_8bit_state(train_cli):
    assert_clean_error(
        train_cli("train", "--optim", "adamw", "--fp32-embedding-state", "--max-steps", "1"),
        "--fp32-embedding-state is for bitsandbytes' 8-bit optimizers",
        "--optim adamw",
    )


def test_trains_resumes_exactly_and_refuses_a_mismatched_resume(train_cli, data, tmp_path):
    from tests.test_resume import assert_same_end, straight_and_resumed

    options = ("--optim", "adamw-8bit", "--fp32-embedding-state", "--max-steps", "8")
    straight, resumed = straight_and_resumed(
        train_cli, data, tmp_path, 4, *options, "--save-every", "4", "--metrics-json",
        str(tmp_path / "m.json"),
    )  # fmt: skip
    assert_same_end(straight, resumed, 8)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["config"]["fp32_embedding_state"] is True
    dtypes = metrics["optimizer_state"]["by_key"]["state1"]["dtypes"]
    assert dtypes == ["float32", "uint8"]

    args = train_args(data, resumed, "--optim", "adamw-8bit", "--max-steps", "9", "--resume")
    assert_clean_error(
        train_cli(*args, "latest"), "32-bit optimizer state for the embeddings", "add --fp32"
    )


@pytest.mark.slow
def test_estimate_applies_it_to_the_8bit_columns_only(train_cli):
    def state_bytes(*options):
        proc = train_cli("estimate", "--json", *options)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        return {r["optimizer"]: r["optimizer_state"]["bytes"] for r in out}

    plain = state_bytes("--optim", "adamw,adamw-8bit")
    kept = state_bytes("--optim", "adamw,adamw-8bit", "--fp32-embedding-state")
    assert kept["adamw"] == plain["adamw"]
    # The tiny preset's word and position embeddings, (193 + 64) x 128 values, go from 1 byte
    # to 4 in each of the two moments, less the 8-bit blocks' scales (4 bytes per started block
    # of 256 values).
    values, blocks = (193 + 64) * 128, -(-193 * 128 // 256) + 64 * 128 // 256
    assert kept["adamw-8bit"] == plain["adamw-8bit"] + 2 * (3 * values - 4 * blocks)
