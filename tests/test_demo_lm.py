"""The causal-LM demo's corpus, tokenizer and tiny-llama settings (effitrain.demo.lm)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from effitrain.demo.lm import (
    DEMO_SAMPLE_PROMPT,
    build_demo_corpus,
    build_lm_tokenizer,
    tiny_llama_config,
)


def _texts(corpus) -> dict[str, list[str]]:
    return {name: list(split["text"]) for name, split in corpus.items()}


@pytest.fixture(scope="module")
def corpus():
    """The default corpus's texts, as lists, by split."""
    return _texts(build_demo_corpus())


@pytest.fixture(scope="module")
def tokenizer():
    return build_lm_tokenizer()


def test_corpus_shape_and_determinism(corpus):
    dataset = build_demo_corpus()
    assert set(dataset) == {"train", "validation"}
    for split in dataset.values():
        assert split.column_names == ["text"]
        assert split.features["text"].dtype == "string"
    assert len(corpus["train"]) > 10 * len(corpus["validation"]) > 0
    assert all(t.endswith(".") for t in corpus["train"] + corpus["validation"])
    # each row is one short document of a few sentences
    sentences = [t.count(". ") + 1 for t in corpus["train"]]
    assert min(sentences) == 2 and max(sentences) == 4

    state = random.getstate()
    from effitrain.demo import lm

    lm._documents.cache_clear()  # really generate again
    again = _texts(build_demo_corpus())
    assert random.getstate() == state  # its own RNG, not the global one
    assert again == corpus
    other = _texts(build_demo_corpus(seed=1))
    assert other["train"] != corpus["train"]
    assert len(build_demo_corpus(num_train=50, num_validation=5)["train"]) == 50


def test_validation_documents_never_in_train(corpus):
    train = set(corpus["train"])
    validation = corpus["validation"]
    assert len(train) == len(corpus["train"])  # no duplicates either
    assert len(set(validation)) == len(validation)
    assert not train & set(validation)
    # nor does any validation report open with a training report's lead sentence
    leads = {t.split(". ")[0] for t in train}
    assert not leads & {t.split(". ")[0] for t in validation}


def test_sample_prompt_is_in_the_corpus_style(corpus):
    assert any(t.startswith(DEMO_SAMPLE_PROMPT + " ") for t in corpus["train"])


def test_tokenizer_round_trips_text(corpus, tokenizer):
    texts = corpus["validation"] + corpus["train"][:200]
    texts += ["Ünïcode, tabs\tand\nnewlines  — 日本語 🙂", " leading space", ""]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # trained on the corpus: its words are single tokens, so a document is about a token a word
    doc = corpus["validation"][0]
    assert len(tokenizer(doc)["input_ids"]) <= len(doc.split()) + doc.count(".") + doc.count(",")


def test_tokenizer_specials(tokenizer):
    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2, 3]
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert set(specials) <= set(tokenizer.all_special_tokens)
    assert tokenizer.unk_token is None  # byte-level: nothing is unknown
    # specials in text are single tokens; plain encoding adds none of its own
    assert tokenizer("a<|im_end|>b")["input_ids"][1] == 3
    assert 0 not in tokenizer("The board sold the plan.")["input_ids"]
    assert tokenizer.model_max_length == 2048
    assert build_lm_tokenizer(64).model_max_length == 64
    assert 512 <= len(tokenizer) <= 4096


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What did the board do?"},
        {"role": "assistant", "content": "It sold the plan."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat did the board do?<|im_end|>\n"
        "<|im_start|>assistant\nIt sold the plan.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == text[: text.index("It sold")]
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert not no_prompt.endswith("assistant\n")

    # assistant turns are marked for completion-only loss
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(marked) == "It sold the plan.<|im_end|>"


def _trained_json_in_subprocess() -> str:
    code = (
        "import sys; from effitrain.demo.lm import _trained_tokenizer_json as t; "
        "sys.stdout.write(t()); import effitrain.demo.lm as m; "
        "assert 'transformers' not in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return proc.stdout


def test_tokenizer_training_is_identical_across_processes(tokenizer):
    # Trained again in a new process (its own hash seed): the same merges and ids as here.
    other = json.loads(_trained_json_in_subprocess())
    here = json.loads(tokenizer.backend_tokenizer.to_str())
    assert other["model"]["merges"] == here["model"]["merges"]
    assert other["model"]["vocab"] == tokenizer.get_vocab()


def test_import_is_light():
    code = (
        "import sys, effitrain.demo.lm; "
        "heavy = {'torch', 'transformers', 'datasets', 'tokenizers'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**tiny_llama_config())).eval()


def test_tiny_llama_config(tokenizer, model):
    config = tiny_llama_config()
    assert config["vocab_size"] == len(tokenizer)
    assert config["bos_token_id"] == config["eos_token_id"] == tokenizer.eos_token_id == 0
    assert config["pad_token_id"] == tokenizer.pad_token_id == 1
    assert tiny_llama_config() is not tiny_llama_config()
    assert model.config.hidden_size % model.config.num_attention_heads == 0

    # parameters: embedding (shared with the output layer), per layer q/k/v/o, the gated MLP
    # and two norms, and the final norm
    v, h, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    expected = v * h + config["num_hidden_layers"] * layer + h
    assert config["tie_word_embeddings"]
    assert sum(p.numel() for p in model.parameters()) == expected
    assert 100_000 < expected < 2_000_000  # tiny: trains in under a minute on one CPU core


def test_forward_gives_the_untrained_loss(corpus, tokenizer, model):
    import torch

    batch = tokenizer(corpus["validation"][:4], padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss.item()
    assert math.isfinite(loss)
    # random init predicts about uniformly: loss near log(vocab size)
    assert abs(loss - math.log(len(tokenizer))) < 0.5


def test_packed_documents_stay_apart(tokenizer, model):
    """Documents packed in one row with restarting position ids give the logits they give
    alone, when the forward runs without a cache (with one, transformers ignores the packing)."""
    import torch

    eos = tokenizer.eos_token_id
    a = tokenizer("The board sold the plan.")["input_ids"] + [eos]
    b = tokenizer("On Friday, the judge rejected the deal.")["input_ids"] + [eos]
    ids = torch.tensor([a + b])
    positions = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed[:, len(a) :], alone)
