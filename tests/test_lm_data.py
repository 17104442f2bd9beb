"""The causal-LM data pipeline: loading and format detection, tokenizing with completion masks,
packing (and that packed blocks attend within each document only), padding, and its errors."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import pytest

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.tasks.lm_data import (
    CHATML_TEMPLATE,
    IGNORE_INDEX,
    build_lm_dataloaders,
    has_label_column,
    load_lm_data,
    pack,
)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat and looked at the door",
    "hello world, how are you today?",
    "what is two plus two? four is the answer.",
    "the river runs down to the sea in the spring",
    "she reads a book by the window every morning",
    "rain falls on the roof of the old house",
    "we walk to the market to buy bread and milk",
]


@pytest.fixture(scope="session")
def tok():
    """A small byte-level BPE tokenizer trained here, with eos, pad and ChatML specials and no
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(SENTENCES * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


@pytest.fixture
def fresh_tok(tok):
    """A copy of ``tok`` (the pipeline may set its chat or pad token)."""
    import copy

    return copy.deepcopy(tok)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(dataset, **kwargs) -> TrainConfig:
    kwargs.setdefault("max_length", 32)
    kwargs.setdefault("batch_size", 4)
    return TrainConfig(dataset=str(dataset), task="causal-lm", **kwargs)


def batches(loader) -> list[dict]:
    return list(loader)


def labelled_spans(labels: list[int]) -> list[list[int]]:
    """Runs of consecutive trained-on label ids."""
    spans, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return [*spans, current] if current else spans


def prompt_rows(n=12):
    return [
        {
            "prompt": f"question {i}: {SENTENCES[i % 8]}?",
            "completion": f" answer {SENTENCES[i % 5]}",
        }
        for i in range(n)
    ]


def chat_rows(n=12):
    return [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"tell me {i}"},
                {"role": "assistant", "content": SENTENCES[i % 8]},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": SENTENCES[(i + 1) % 8]},
            ]
        }
        for i in range(n)
    ]


def instruction_rows(n=12):
    return [
        {"instruction": f"repeat {i}", "input": SENTENCES[i % 8] if i % 2 else "", "output": "ok"}
        for i in range(n)
    ]


# --- loading and format detection ---


def test_txt_file_paragraphs_are_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(f"{s}\nsecond line {i}" for i, s in enumerate(SENTENCES * 3)))
    data = load_lm_data(config(path))
    assert (data.format, data.columns) == ("text", ("text",))
    assert (data.packing, data.completion_only) == (True, False)
    assert data.validation_source == "10% held out of train"
    assert len(data.train) + len(data.validation) == 24
    assert all("\nsecond line" in t for t in data.train["text"])


@pytest.mark.parametrize(
    ("rows", "fmt", "columns"),
    [
        (chat_rows(), "messages", ("messages",)),
        (prompt_rows(), "prompt-completion", ("prompt", "completion")),
        (instruction_rows(), "instruction", ("instruction", "input", "output")),
        ([{"instruction": "a", "output": "b"}] * 4, "instruction", ("instruction", "output")),
        ([{"text": s, "id": i} for i, s in enumerate(SENTENCES)], "text", ("text",)),
        # messages wins over the other columns
        ([{**r, "text": "x"} for r in chat_rows()], "messages", ("messages",)),
    ],
)
def test_format_detected_by_columns(tmp_path, rows, fmt, columns):
    data = load_lm_data(config(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert (data.format, data.columns) == (fmt, columns)
    assert data.completion_only is (fmt != "text")
    assert data.packing is (fmt == "text")


def test_options_override_defaults(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", prompt_rows())
    data = load_lm_data(config(path, packing=True, completion_only_loss=False))
    assert (data.packing, data.completion_only) == (True, False)


@pytest.mark.parametrize("suffix", ["csv", "parquet", "tsv"])
def test_tabular_files(tmp_path, suffix):
    import datasets

    rows = [{"body": s} for s in SENTENCES]
    path = tmp_path / f"d.{suffix}"
    ds = datasets.Dataset.from_list(rows)
    if suffix == "parquet":
        ds.to_parquet(path)
    else:
        ds.to_csv(path, index=False, sep="\t" if suffix == "tsv" else ",")
    data = load_lm_data(config(path, text_columns=["body"]))
    assert (data.format, data.columns) == ("text", ("body",))


def test_has_label_column():
    assert has_label_column(["text", "label"])
    assert not has_label_column(["text", "messages"])


def test_folder_of_txt_files_with_named_splits(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text("\n\n".join(SENTENCES))
    (folder / "validation.txt").write_text("\n\n".join(SENTENCES[:3]))
    data = load_lm_data(config(folder))
    assert data.validation_source == "split 'validation'"
    assert (len(data.train), len(data.validation)) == (8, 3)


def test_folder_of_several_txt_files(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n".join(SENTENCES[:4]))
    (folder / "b.txt").write_text("\n\n".join(SENTENCES[4:]) + "\n\nlast one here")
    data = load_lm_data(config(folder))
    assert len(data.train) + len(data.validation) == 9


def test_folder_of_jsonl_files(tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", chat_rows(6))
    write_jsonl(folder / "test.jsonl", chat_rows(2))
    data = load_lm_data(config(folder))
    assert (data.format, data.validation_source, len(data.validation)) == (
        "messages",
        "split 'test'",
        2,
    )


def test_save_to_disk_folder(tmp_path):
    import datasets

    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(prompt_rows(10)),
        validation=datasets.Dataset.from_list(prompt_rows(3)),
    )
    splits.save_to_disk(tmp_path / "saved")
    data = load_lm_data(config(tmp_path / "saved"))
    assert (data.format, len(data.train), len(data.validation)) == ("prompt-completion", 10, 3)
    assert data.source == str(tmp_path / "saved")


def test_validation_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in SENTENCES])
    dev = tmp_path / "dev.txt"
    dev.write_text("one paragraph\n\nanother one")
    data = load_lm_data(TrainConfig(train_file=str(train), validation_file=str(dev)))
    assert (data.validation_source, len(data.train), len(data.validation)) == (str(dev), 8, 2)


def test_demo_dataset_uses_the_built_in_corpus(monkeypatch):
    import sys
    import types

    import datasets

    corpus = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": SENTENCES}),
        validation=datasets.Dataset.from_dict({"text": SENTENCES[:2]}),
    )
    module = types.ModuleType("effitrain.demo.lm")
    module.build_demo_corpus = lambda seed=0: corpus
    monkeypatch.setitem(sys.modules, "effitrain.demo.lm", module)
    data = load_lm_data(TrainConfig(task="causal-lm"))
    assert (data.format, len(data.train), data.validation_source) == (
        "text",
        8,
        "split 'validation'",
    )


# --- tokenizing: padding and completion masks ---


def test_padded_batches(tmp_path, fresh_tok):
    long = " ".join(SENTENCES)  # far longer than max_length: cut into max_length pieces
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in [*SENTENCES, long] * 2])
    options = config(path, packing=False, max_length=16)
    data = load_lm_data(options)
    train_loader, eval_loader = build_lm_dataloaders(data, fresh_tok, options, 8)
    for batch in batches(train_loader) + batches(eval_loader):
        assert set(batch) == {"input_ids", "attention_mask", "labels", "document_lengths"}
        assert all(
            batch[k].dtype.is_floating_point is False and batch[k].dtype.itemsize == 8
            for k in ("input_ids", "attention_mask", "labels")
        )
        # each row: its tokens, then its padding (a document of its own)
        for row, lengths in zip(batch["attention_mask"], batch["document_lengths"], strict=True):
            tokens, width = int(row.sum()), len(row)
            assert lengths == ((tokens,) if tokens == width else (tokens, width - tokens))
        assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] <= 16
        pad = batch["attention_mask"] == 0
        assert (batch["input_ids"][pad] == fresh_tok.pad_token_id).all()
        assert (batch["labels"][pad] == IGNORE_INDEX).all()
        assert (batch["labels"][~pad] == batch["input_ids"][~pad]).all()
    pieces = [
        row[m.bool()].tolist()
        for b in batches(train_loader) + batches(eval_loader)
        for row, m in zip(b["input_ids"], b["attention_mask"], strict=True)
    ]
    whole = fresh_tok(long)["input_ids"] + [fresh_tok.eos_token_id]
    chunks = [whole[i : i + 16] for i in range(0, len(whole), 16)]
    assert sum(chunk in pieces for chunk in chunks if len(chunk) >= 2) >= len(chunks) - 1


def test_prompt_completion_mask(tmp_path, fresh_tok):
    rows = prompt_rows()
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    options = config(path, validation_file=str(path), max_length=64)
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    labels = [row for batch in eval_loader for row in batch["labels"].tolist()]
    for row, label in zip(rows, labels, strict=True):
        (span,) = labelled_spans(label)
        assert fresh_tok.decode(span) == row["completion"] + "<|endoftext|>"


def test_prompt_completion_full_loss(tmp_path, fresh_tok):
    path = write_jsonl(tmp_path / "d.jsonl", prompt_rows())
    options = config(path, validation_file=str(path), max_length=64, completion_only_loss=False)
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    batch = next(iter(eval_loader))
    real = batch["attention_mask"].bool()
    assert (batch["labels"][real] == batch["input_ids"][real]).all()


def test_messages_mask_only_assistant_turns(tmp_path, fresh_tok):
    rows = chat_rows()
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    options = config(path, validation_file=str(path), max_length=128)
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    assert fresh_tok.chat_template == CHATML_TEMPLATE
    assert any("no chat template; using ChatML" in note for note in data.notes)
    labels = [row for batch in eval_loader for row in batch["labels"].tolist()]
    for row, label in zip(rows, labels, strict=True):
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        first, second = labelled_spans(label)
        assert fresh_tok.decode(first) == answers[0] + "<|im_end|>\n"
        assert fresh_tok.decode(second) == answers[1] + "<|im_end|>\n<|endoftext|>"


def test_instruction_becomes_a_conversation(tmp_path, fresh_tok):
    rows = instruction_rows(4)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    options = config(path, validation_file=str(path), max_length=128)
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    batch = next(iter(eval_loader))
    for row, ids, label in zip(
        rows, batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True
    ):
        text = fresh_tok.decode(ids, skip_special_tokens=False)
        user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        assert text.startswith(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        (span,) = labelled_spans(label)
        assert fresh_tok.decode(span) == "ok<|im_end|>\n<|endoftext|>"


def test_own_chat_template_is_used(tmp_path, fresh_tok):
    fresh_tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    rows = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello world"},
            ]
        }
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows * 3)
    options = config(path, validation_file=str(path))
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    batch = next(iter(eval_loader))
    assert data.notes == []
    (span,) = labelled_spans(batch["labels"][0].tolist())
    assert fresh_tok.decode(span) == "hello world\n<|endoftext|>"


def test_template_that_rewrites_history_falls_back_to_full_loss(tmp_path, fresh_tok):
    # The turn count at the start changes with every turn: no rendering is a prefix of the next.
    fresh_tok.chat_template = (
        "{{ messages | length }} turns\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", chat_rows(3))
    options = config(path, validation_file=str(path), max_length=128)
    data = load_lm_data(options)
    _, eval_loader = build_lm_dataloaders(data, fresh_tok, options, None)
    assert any(
        note.startswith("3 of 3 validation conversations are trained on in full")
        for note in data.notes
    )
    batch = next(iter(eval_loader))
    real = batch["attention_mask"].bool()
    assert (batch["labels"][real] == batch["input_ids"][real]).all()


def test_pad_token_defaults_to_eos(tmp_path, fresh_tok):
    fresh_tok.pad_token = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES])
    data = load_lm_data(config(path, packing=False))
    build_lm_dataloaders(data, fresh_tok, config(path), None)
    assert fresh_tok.pad_token_id == fresh_tok.eos_token_id
    assert any("no pad token" in note for note in data.notes)


def test_loaders_seeded_and_ordered(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s * 3} for s in SENTENCES * 4])
    data = load_lm_data(config(path, validation_file=str(path)))

    def first_ids(seed):
        train, evaluation = build_lm_dataloaders(data, tok, config(path, seed=seed), None)
        return next(iter(train))["input_ids"].tolist(), batches(evaluation)

    (a, eval_a), (b, _), (c, _) = first_ids(1), first_ids(1), first_ids(2)
    assert a == b and a != c
    assert eval_a[0]["input_ids"].shape[0] == 8  # 2 x batch size
    ordered = [row for batch in eval_a for row in batch["input_ids"].tolist()]
    unshuffled = build_lm_dataloaders(data, tok, config(path, eval_batch_size=3), None)[1]
    assert [row for batch in unshuffled for row in batch["input_ids"].tolist()] == ordered


# --- packing ---


def test_pack_boundaries():
    import numpy as np

    # documents of 3, 5 and 4 tokens, blocks of 4: the last partial block (0 tokens) is dropped
    ids = np.arange(1, 13)
    packed = pack(ids, ids.copy(), np.array([0, 3, 8, 12]), 4)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    # doc 2 starts at block 0 position 3: its first label is masked; doc 3 starts a block
    assert packed["labels"].tolist() == [[1, 2, 3, -100], [5, 6, 7, 8], [9, 10, 11, 12]]


def test_pack_drops_last_partial_block_keeps_a_single_one():
    import numpy as np

    ids = np.arange(10)
    assert pack(ids, ids, np.array([0, 6, 10]), 4)["input_ids"].shape == (2, 4)
    short = pack(ids[:6], ids[:6], np.array([0, 2, 6]), 8)
    assert short["input_ids"].tolist() == [list(range(6))]
    assert short["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]
    assert short["labels"].tolist() == [[0, 1, -100, 3, 4, 5]]


def test_packed_batches(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES * 3])
    data = load_lm_data(config(path, validation_file=str(path), max_length=24))
    train, evaluation = build_lm_dataloaders(data, tok, config(path, max_length=24), None)
    eos = tok.eos_token_id
    rows = [(b, i) for b in batches(evaluation) for i in range(len(b["input_ids"]))]
    assert len(rows) == sum(len(tok(s)["input_ids"]) + 1 for s in SENTENCES * 3) // 24
    for batch in batches(train) + batches(evaluation):
        assert set(batch) == {"input_ids", "labels", "position_ids", "document_lengths"}
        assert batch["input_ids"].shape[1] == 24
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        assert (positions[:, 0] == 0).all()
        starts = positions == 0
        # the document lengths the attention runs over: from one position 0 to the next
        for row, lengths in zip(starts, batch["document_lengths"], strict=True):
            bounds = [*row.nonzero().flatten().tolist(), len(row)]
            assert lengths == tuple(b - a for a, b in itertools.pairwise(bounds))
        # a document starts right after an eos, and only there
        after_eos = ids[:, :-1] == eos
        assert (starts[:, 1:] == after_eos).all()
        assert (labels[:, 1:][starts[:, 1:]] == IGNORE_INDEX).all()
        assert (labels[~starts] == ids[~starts]).all()


def test_packed_completion_only(tmp_path, fresh_tok):
    rows = prompt_rows(6)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_lm_data(config(path, validation_file=str(path), packing=True, max_length=20))
    _, evaluation = build_lm_dataloaders(data, fresh_tok, config(path, max_length=20), None)
    labels = [t for b in evaluation for row in b["labels"].tolist() for t in row]
    text = fresh_tok.decode([t for t in labels if t != IGNORE_INDEX])
    # every labelled token belongs to a completion (or its eos); no prompt text leaks in
    assert "question" not in text and text.count("answer") >= 3


def _models(vocab_size):
    import transformers as tf

    small = {"vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 2, "intermediate_size": 64}
    return {
        "llama": tf.LlamaForCausalLM(tf.LlamaConfig(**small)),
        "qwen2": tf.Qwen2ForCausalLM(tf.Qwen2Config(**small, num_key_value_heads=2)),
        "gpt2": tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=vocab_size,
                n_embd=32,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
    }


@pytest.fixture(scope="module")
def packed_block(tok, tmp_path_factory):
    path = write_jsonl(
        tmp_path_factory.mktemp("pack") / "d.jsonl", [{"text": s} for s in SENTENCES * 2]
    )
    data = load_lm_data(config(path, validation_file=str(path), max_length=48))
    _, evaluation = build_lm_dataloaders(data, tok, config(path, max_length=48), None)
    return next(iter(evaluation))


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "documents"])
def test_packed_logits_equal_documents_run_alone(
    tok, packed_block, architecture, attention, monkeypatch
):
    """Documents: SDPA per document (``effitrain.tasks.document_attention``, here from the
    shortest rows), told where the documents lie by the batch's ``document_lengths``."""
    import torch

    from effitrain.tasks import document_attention

    monkeypatch.setattr(document_attention, "MASKED_UP_TO", 0)

    torch.manual_seed(0)
    model = _models(len(tok))[architecture].eval()
    extra = {}
    if attention == "documents":
        assert document_attention.use(model)
        extra = {"document_lengths": packed_block["document_lengths"]}
    else:
        model.set_attn_implementation(attention)
    ids, positions = packed_block["input_ids"], packed_block["position_ids"]
    given = document_attention.documents_given() if extra else contextlib.nullcontext()
    with torch.no_grad():
        with given:
            packed = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits
        documents = 0
        for row in range(ids.shape[0]):
            starts = [*(positions[row] == 0).nonzero().flatten().tolist(), ids.shape[1]]
            for start, end in zip(starts, starts[1:], strict=False):
                alone = model(input_ids=ids[row : row + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[row, start:end], alone, atol=1e-5, rtol=0)
                documents += 1
        assert documents > ids.shape[0]  # some block holds several documents
        # With a cache (the default use_cache=True) transformers ignores the packing.
        cached = model(input_ids=ids, position_ids=positions).logits
        assert not torch.allclose(cached, packed, atol=1e-3)


@pytest.mark.parametrize("masked_up_to", [0, 1024])
def test_document_attention_builds_no_mask_and_trains_as_the_mask_does(
    tok, packed_block, masked_up_to, monkeypatch
):
    """The same loss and gradients as transformers' per-document mask, for a packed block and a
    padded batch; no tensor of (rows x length x length) is made on the way, except for rows
    short enough to keep the mask (``MASKED_UP_TO``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from effitrain.tasks import document_attention
    from effitrain.tasks.lm_data import lm_collator

    monkeypatch.setattr(document_attention, "MASKED_UP_TO", masked_up_to)

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.shapes.append(tuple(out.shape))
            return out

    ids = packed_block["input_ids"]
    padded = lm_collator(False, tok.pad_token_id, tok)(
        [{"input_ids": row[: 48 - 7 * i].tolist(), "labels": row[: 48 - 7 * i].tolist()}
         for i, row in enumerate(ids)]
    )  # fmt: skip
    assert any(len(lengths) == 2 for lengths in padded["document_lengths"])
    for batch in (packed_block, padded):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "document_lengths")}
        results = []
        for documents in (False, True):
            torch.manual_seed(0)
            model = _models(len(tok))["llama"]
            if documents:
                assert document_attention.use(model)
                inputs = {**inputs, "document_lengths": batch["document_lengths"]}
            given = document_attention.documents_given() if documents else contextlib.nullcontext()
            with Largest() as seen, given:
                logits = model(**inputs, use_cache=False).logits
            labels = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            loss.backward()
            length = ids.shape[1]
            square = any(shape[-2:] == (length, length) for shape in seen.shapes)
            assert square is not (documents and ids.shape[1] > masked_up_to)
            results.append((loss, [p.grad for p in model.parameters()]))
        (loss, grads), (doc_loss, doc_grads) = results
        torch.testing.assert_close(doc_loss, loss)
        for grad, doc_grad in zip(grads, doc_grads, strict=True):
            torch.testing.assert_close(doc_grad, grad, atol=1e-6, rtol=1e-4)


# --- errors ---


def error(config_or_call) -> str:
    with pytest.raises(EffitrainError) as info:
        config_or_call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_error_empty_files(tmp_path):
    for name in ("e.txt", "e.jsonl"):
        (tmp_path / name).write_text("")
        assert "is empty" in error(lambda n=name: load_lm_data(config(tmp_path / n)))


def test_error_empty_split(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": []}).to_parquet(tmp_path / "none.parquet")
    assert "none.parquet' is empty (no rows)" in error(
        lambda: load_lm_data(config(tmp_path / "none.parquet"))
    )
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in SENTENCES])
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": ""}])
    assert f"validation set ({dev}) is empty" in error(
        lambda: load_lm_data(TrainConfig(train_file=str(train), validation_file=str(dev)))
    )


def test_error_all_texts_empty(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": "  "}, {"text": None}])
    assert "every 'text' value is empty" in error(lambda: load_lm_data(config(path)))


def test_error_no_usable_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}] * 3)
    message = error(lambda: load_lm_data(config(path)))
    assert "columns found: question, answer" in message
    assert "prompt+completion" in message and "--text-columns" in message


def test_error_two_text_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": "x", "b": "y"}] * 3)
    assert "one column under --task causal-lm" in error(
        lambda: load_lm_data(config(path, text_columns=["a", "b"]))
    )


def test_error_completion_only_on_plain_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES])
    assert "needs prompt/completion" in error(
        lambda: load_lm_data(config(path, completion_only_loss=True))
    )


@pytest.mark.parametrize(
    "messages, expected",
    [
        ("hello", "'messages' is a string (\"hello\") on line 4 but a list on line 1"),
        ([], "training row index 3: 'messages' must be"),
        ([{"role": "user"}], "training row index 3: 'messages' must be"),
        ([{"role": "user", "content": None}], "training row index 3: 'messages' must be"),
    ],
)
def test_error_messages_not_a_conversation(tmp_path, messages, expected):
    rows = [*chat_rows(3), {"messages": messages}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert expected in error(lambda: load_lm_data(config(path)))


def test_error_missing_prompt_or_completion(tmp_path):
    rows = prompt_rows(5)
    rows[2]["completion"] = None
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert "training row index 2: 'completion' is missing" in error(
        lambda: load_lm_data(config(path))
    )


def test_error_every_example_too_short(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "completion": ""}] * 4)
    data = load_lm_data(config(path))
    assert "shorter than 2 tokens" in error(lambda: build_lm_dataloaders(data, tok, config(path)))


def test_error_every_completion_cut_off(tmp_path, tok):
    rows = [{"prompt": " ".join(SENTENCES), "completion": " yes"}] * 4
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_lm_data(config(path, max_length=16))
    message = error(lambda: build_lm_dataloaders(data, tok, config(path, max_length=16)))
    assert "every completion of the training set is cut off by --max-length 16" in message
    assert "raise --max-length" in message


def test_error_no_assistant_turn(tmp_path, fresh_tok):
    rows = [{"messages": [{"role": "user", "content": s}]} for s in SENTENCES]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_lm_data(config(path))
    assert "has an assistant turn to train on" in error(
        lambda: build_lm_dataloaders(data, fresh_tok, config(path))
    )


def test_error_tokenizer_without_eos(tmp_path, fresh_tok):
    fresh_tok.eos_token = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": s} for s in SENTENCES])
    data = load_lm_data(config(path))
    assert "no end-of-sequence token" in error(
        lambda: build_lm_dataloaders(data, fresh_tok, config(path))
    )


@pytest.mark.parametrize(
    "packing, model_type, expect_packing, note",
    [
        (None, "llama", True, None),
        (None, "opt", False, "padding instead of packing"),
        (None, "some_new_arch", False, "padding instead of packing"),
        (True, "some_new_arch", True, "not verified"),
        (False, "llama", False, None),
    ],
)
def test_packing_follows_what_the_architecture_keeps_apart(
    tmp_path, packing, model_type, expect_packing, note
):
    from effitrain.tasks.lm_data import check_packing

    (tmp_path / "t.txt").write_text("\n\n".join(SENTENCES))
    cfg = config(tmp_path / "t.txt", packing=packing)
    data = load_lm_data(cfg)
    check_packing(data, model_type, cfg)
    assert data.packing is expect_packing
    assert any(note in n for n in data.notes) if note else not data.notes


def test_packing_refused_where_documents_would_mix(tmp_path):
    from effitrain.tasks.lm_data import check_packing

    (tmp_path / "t.txt").write_text("\n\n".join(SENTENCES))
    cfg = config(tmp_path / "t.txt", packing=True)
    with pytest.raises(EffitrainError, match="--no-packing"):
        check_packing(load_lm_data(cfg), "bloom", cfg)


def test_error_unknown_chat_role(tmp_path):
    rows = chat_rows(4)
    rows[2]["messages"][3]["role"] = "wizard"
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert error(lambda: load_lm_data(config(path))) == (
        "training row index 2: message 4 has role 'wizard'; roles allowed: system, user, "
        "assistant, tool"
    )


def test_tool_turns_are_allowed(tmp_path):
    rows = chat_rows(4)
    rows[1]["messages"].insert(3, {"role": "tool", "content": "42"})
    assert load_lm_data(config(write_jsonl(tmp_path / "d.jsonl", rows))).format == "messages"


def test_error_packing_leaves_no_validation_token_to_train_on(tmp_path, tok):
    """Packing drops a split's last partial block: a validation set whose one completion sits
    there would otherwise evaluate no token (perplexity 1.00)."""
    rows = [{"prompt": " ".join(SENTENCES), "completion": " yes"}]
    train = write_jsonl(tmp_path / "train.jsonl", rows * 8)
    dev = write_jsonl(tmp_path / "dev.jsonl", rows)
    cfg = TrainConfig(train_file=str(train), validation_file=str(dev), max_length=16, packing=True)
    message = error(lambda: build_lm_dataloaders(load_lm_data(cfg), tok, cfg))
    assert message.startswith("no completion of the validation set is left to train on once packed")
    assert "--no-packing" in message
