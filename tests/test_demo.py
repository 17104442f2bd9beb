"""Tests for the built-in offline demo (dataset, tokenizer, tiny preset). Fast, offline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from effitrain.demo import (  # noqa: E402
    DEMO_LABEL_NAMES,
    build_demo_dataset,
    build_tokenizer,
    tiny_model_config,
)

N_TRAIN, N_VAL = 400, 100


@pytest.fixture(scope="module")
def demo():
    return build_demo_dataset(seed=0, num_train=N_TRAIN, num_validation=N_VAL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_import_is_cheap():
    code = (
        "import sys, effitrain.demo\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_splits_columns_and_labels(demo):
    import datasets

    assert set(demo) == {"train", "validation"}
    assert demo["train"].num_rows == N_TRAIN
    assert demo["validation"].num_rows == N_VAL
    for split in demo.values():
        assert split.column_names == ["sentence1", "sentence2", "label"]
        assert split.features["sentence1"] == datasets.Value("string")
        assert split.features["sentence2"] == datasets.Value("string")
        label = split.features["label"]
        assert isinstance(label, datasets.ClassLabel)
        assert label.names == DEMO_LABEL_NAMES == ["not_equivalent", "equivalent"]


def test_labels_balanced(demo):
    for split in demo.values():
        labels = split["label"]
        share = sum(labels) / len(labels)
        assert 0.45 <= share <= 0.55, share
        assert set(labels) == {0, 1}


def test_deterministic_and_seed_dependent(demo):
    again = build_demo_dataset(seed=0, num_train=N_TRAIN, num_validation=N_VAL)
    for name in ("train", "validation"):
        assert demo[name].to_dict() == again[name].to_dict()
    other = build_demo_dataset(seed=1, num_train=N_TRAIN, num_validation=N_VAL)
    assert other["train"]["sentence1"] != demo["train"]["sentence1"]


KNOWN_FIRST = {
    "sentence1": "The government unveiled the yearly contract following a lengthy debate.",
    "sentence2": "The government announced the yearly contract following a lengthy debate.",
    "label": 1,
}
"""Pins the generator: the same strings on every machine and in every Python process (no hash
randomization, no global RNG). Update deliberately if the generator changes, and run the demo's
accuracy benchmark (benchmarks/learning/) again."""


def test_known_first_example_is_stable():
    assert build_demo_dataset(seed=0, num_train=2, num_validation=1)["train"][0] == KNOWN_FIRST


@pytest.mark.slow  # a fresh process: its imports are the cost
def test_known_first_example_is_stable_in_another_process():
    """Another hash seed and a seeded global RNG change nothing."""
    code = (
        "import random; random.seed(99)\n"
        "from effitrain.demo import build_demo_dataset\n"
        "print(repr(build_demo_dataset(seed=0, num_train=2, num_validation=1)['train'][0]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()
    assert out == repr(KNOWN_FIRST)


def test_no_validation_pair_in_train(demo):
    train_pairs = set(zip(demo["train"]["sentence1"], demo["train"]["sentence2"], strict=True))
    val_pairs = list(
        zip(demo["validation"]["sentence1"], demo["validation"]["sentence2"], strict=True)
    )
    assert not train_pairs.intersection(val_pairs)
    assert len(set(val_pairs)) == len(val_pairs)
    assert len(train_pairs) == N_TRAIN


def test_sentences_look_like_english(demo):
    row = demo["train"][0]
    for text in (row["sentence1"], row["sentence2"]):
        assert text[0].isupper() and text.endswith(".")
        assert 3 <= len(text.split()) <= 30


def test_invalid_sizes():
    with pytest.raises(ValueError):
        build_demo_dataset(num_train=0)


def test_pair_encoding(tokenizer):
    enc = tokenizer("The committee approved the budget.", "The budget was approved.")
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert tokens.count("[SEP]") == 2
    assert "[UNK]" not in tokens
    assert "token_type_ids" not in enc  # DistilBERT takes none
    enc = tokenizer("a b", "c d", return_token_type_ids=True)
    assert enc["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]


def test_unknown_words_fall_back_to_characters(tokenizer):
    tokens = tokenizer.tokenize("Zebras juggle quixotic xylophones")
    assert tokens and tokens.count("[UNK]") == 0
    assert "##" + "s" in tokens
    assert tokenizer.decode(tokenizer("Zebras juggle")["input_ids"], skip_special_tokens=True) == (
        "zebras juggle"
    )


def test_tokenizer_specials_and_sizes(tokenizer):
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 0
    assert tokenizer.unk_token == "[UNK]"
    assert tokenizer.cls_token == "[CLS]" and tokenizer.sep_token == "[SEP]"
    assert tokenizer.mask_token == "[MASK]"
    assert tokenizer.model_max_length == 512
    assert len(tokenizer) == tiny_model_config()["vocab_size"]
    assert len(tokenizer) < 1000


def test_every_demo_word_is_one_token(tokenizer, demo):
    for text in demo["train"]["sentence1"][:50] + demo["train"]["sentence2"][:50]:
        for token in tokenizer.tokenize(text):
            assert not token.startswith("##") and token != "[UNK]", (text, token)


def test_tokenizer_round_trip(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = ("On Monday, the panel endorsed the new budget.", "Zebras quietly approved it.")
    assert loaded(*text)["input_ids"] == tokenizer(*text)["input_ids"]
    assert len(loaded) == len(tokenizer)
    assert loaded.pad_token_id == tokenizer.pad_token_id
    assert loaded.model_max_length == tokenizer.model_max_length
    assert list(loaded.model_input_names) == ["input_ids", "attention_mask"]


def test_collator_pads(tokenizer, demo):
    from transformers import DataCollatorWithPadding

    rows = demo["train"].select(range(4))
    features = [
        dict(
            tokenizer(r["sentence1"], r["sentence2"], truncation=True, max_length=64),
            labels=r["label"],
        )
        for r in rows
    ]
    batch = DataCollatorWithPadding(tokenizer)(features)
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 4
    assert set(batch) == {"input_ids", "attention_mask", "labels"}


def test_tiny_model_builds_and_runs(tokenizer):
    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(**tiny_model_config(), num_labels=2)
    model = DistilBertForSequenceClassification(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    batch = tokenizer(["a b c"], ["a b"], return_tensors="pt")
    out = model(**batch, labels=torch.tensor([1]))
    assert out.logits.shape == (1, 2)


def test_demo_pairs_fit_the_tiny_model(tokenizer, demo):
    # The tiny preset caps inputs at its position count; the demo must never be truncated.
    longest = max(
        len(tokenizer(row["sentence1"], row["sentence2"])["input_ids"])
        for split in demo.values()
        for row in split
    )
    assert longest <= tiny_model_config()["max_position_embeddings"]


def test_tiny_model_config_is_a_fresh_dict():
    config = tiny_model_config()
    config["n_layers"] = 99
    assert tiny_model_config()["n_layers"] == 2
