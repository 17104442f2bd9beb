"""Preference data (effitrain.tasks.preference_data): TRL's formats tokenized to the ids TRL's own
DPOTrainer makes, truncation that keeps the prompt's end and says how many pairs it cut, bad rows
named in one line, batches in the contract's layout with example ids that survive shuffling, and
the built-in demo pairs."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from effitrain.config import TrainConfig
from effitrain.errors import EffitrainError
from effitrain.tasks.lm_data import IGNORE_INDEX
from effitrain.tasks.preference_data import (
    PreferenceCollator,
    build_preference_dataloaders,
    load_preference_data,
    tokenize_pair,
    tokenize_preference,
    truncate,
)

EXPLICIT = [
    {"prompt": "The committee approved", "chosen": " the budget.", "rejected": " the plan."},
    # no space at the boundary: "is" + "blue" may merge into other tokens than "is" alone
    {"prompt": "The sky is", "chosen": "blue", "rejected": " green<|endoftext|>"},
    {"prompt": "On Monday, the board", "chosen": " sold the report.", "rejected": " bought it."},
]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": "Who approved the budget?"}],
        "chosen": [{"role": "assistant", "content": "The committee."}],
        "rejected": [{"role": "assistant", "content": "Nobody knows."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What was sold?"},
        ],
        "chosen": [{"role": "assistant", "content": "The contract."}],
        "rejected": [{"role": "assistant", "content": "A spokesperson said it was good news."}],
    },
]
IMPLICIT = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "The judge sold the deal on Friday.", "rejected": "The judge bought it."},
]
IMPLICIT_CONVERSATIONAL = [
    {
        "chosen": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is blue."},
        ],
        "rejected": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is green."},
        ],
    },
]
ROWS = {
    "explicit": EXPLICIT,
    "conversational": CONVERSATIONAL,
    "implicit": IMPLICIT,
    "implicit-conversational": IMPLICIT_CONVERSATIONAL,
}


@pytest.fixture(scope="module")
def tokenizer():
    from effitrain.demo.lm import build_lm_tokenizer

    return build_lm_tokenizer()


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _trl_ids(rows, tokenizer) -> list[dict[str, list[int]]]:
    """TRL 1.16's own tokenization: DPOTrainer._prepare_dataset on the rows (nothing of the
    trainer but the tokenizer and the arguments it reads)."""
    import datasets

    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_end")
    dataset = datasets.Dataset.from_list(rows)
    prepared = trl_dpo.DPOTrainer._prepare_dataset(trainer, dataset, tokenizer, args, "train")
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]


@pytest.mark.slow  # importing TRL's trainer takes ~9 s here; the comparison itself is fast
@pytest.mark.parametrize("fmt", list(ROWS))
def test_token_ids_equal_trls(fmt, tokenizer):
    rows = ROWS[fmt]
    assert [tokenize_pair(row, tokenizer, fmt) for row in rows] == _trl_ids(rows, tokenizer)


@pytest.mark.parametrize("fmt", list(ROWS))
def test_each_format_loads_and_batches_its_token_ids(fmt, tmp_path, tokenizer):
    rows = ROWS[fmt]
    path = _write(tmp_path / "train.jsonl", rows)
    data = load_preference_data(
        TrainConfig(task="preference", train_file=path, validation_file=path)
    )
    assert data.format == fmt
    ours = [tokenize_pair(row, tokenizer, fmt) for row in rows]
    # the batch holds exactly those ids: prompt + answer, labels on the answer only
    train, _ = tokenize_preference(data, tokenizer, max_length=512)
    batch = PreferenceCollator(tokenizer.pad_token_id)([train[i] for i in range(len(train))])
    assert batch["example"].tolist() == list(range(len(rows)))
    for i, ids in enumerate(ours):
        assert ids["chosen_ids"] and ids["rejected_ids"]
        for row, answer in ((i, "chosen"), (len(rows) + i, "rejected")):
            length = int(batch["attention_mask"][row].sum())
            prompt = len(ids["prompt_ids"])
            assert (
                batch["input_ids"][row, :length].tolist()
                == ids["prompt_ids"] + ids[f"{answer}_ids"]
            )
            labels = batch["labels"][row].tolist()
            assert labels[:prompt] == [IGNORE_INDEX] * prompt
            assert labels[prompt:length] == ids[f"{answer}_ids"]
            assert set(labels[length:]) <= {IGNORE_INDEX}


def test_the_batch_layout_and_padding(tokenizer):
    features = [
        {"chosen_input_ids": [5, 6, 7], "chosen_start": 1, "rejected_input_ids": [5, 8], "rejected_start": 1, "example": 4},
        {"chosen_input_ids": [9, 10], "chosen_start": 0, "rejected_input_ids": [9, 11, 12, 13, 14], "rejected_start": 2, "example": 0},
    ]  # fmt: skip
    batch = PreferenceCollator(pad_token_id=1, pad_to_multiple_of=8)(features)
    assert (
        batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype.is_floating_point is False
    )
    assert batch["input_ids"][:, :5].tolist() == [
        [5, 6, 7, 1, 1], [9, 10, 1, 1, 1], [5, 8, 1, 1, 1], [9, 11, 12, 13, 14]
    ]  # fmt: skip
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 2, 2, 5]
    assert batch["labels"][:, :5].tolist() == [
        [-100, 6, 7, -100, -100], [9, 10, -100, -100, -100],
        [-100, 8, -100, -100, -100], [-100, -100, 12, 13, 14],
    ]  # fmt: skip
    assert batch["example"].tolist() == [4, 0]


def test_truncation_drops_the_prompt_start_first():
    assert truncate([1, 2, 3], [4, 5], 10) == ([1, 2, 3], [4, 5])
    assert truncate([1, 2, 3, 4], [5, 6], 4) == ([3, 4], [5, 6])
    assert truncate([1, 2, 3], [4, 5, 6, 7, 8], 4) == ([], [4, 5, 6, 7])


def test_truncation_counts_the_pairs_cut(tmp_path, tokenizer):
    rows = [
        {"prompt": "The committee approved the new budget on Monday in London.", "chosen": " Yes.", "rejected": " No."},
        {"prompt": "The", "chosen": ".", "rejected": ","},
    ]  # fmt: skip
    path = _write(tmp_path / "train.jsonl", rows)
    data = load_preference_data(TrainConfig(train_file=path, validation_file=path))
    train, validation = tokenize_preference(data, tokenizer, max_length=6)
    assert data.notes == [
        "1 of 2 training examples were cut to --max-length 6 (prompt start first)",
        "1 of 2 validation examples were cut to --max-length 6 (prompt start first)",
    ]
    full = tokenize_pair(rows[0], tokenizer, "explicit")
    kept = 6 - len(full["chosen_ids"])
    assert 0 < kept < len(full["prompt_ids"])
    assert train[0]["chosen_input_ids"] == full["prompt_ids"][-kept:] + full["chosen_ids"]
    assert train[0]["chosen_start"] == kept
    short = tokenize_pair(rows[1], tokenizer, "explicit")
    assert train[1]["chosen_input_ids"] == short["prompt_ids"] + short["chosen_ids"]
    assert all(len(ids) <= 6 for ids in [*train["chosen_input_ids"], *train["rejected_input_ids"]])


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ([{"question": "a", "answer": "b"}], ["no preference columns; columns found: question, answer", "accepted: prompt+chosen+rejected"]),
        ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": "", "rejected": " c"}], ["training data (", "row index 1: the 'chosen' answer is empty"]),
        ([{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2 + [{"prompt": "a", "chosen": " b", "rejected": " b"}], ["row index 2: 'chosen' and 'rejected' are identical"]),
        ([{"prompt": "a", "chosen": " b", "rejected": "  "}], ["row index 0: the 'rejected' answer is empty"]),
        ([{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}, {"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": [{"role": "assistant", "content": "c"}]}], ["row index 1: 'chosen' must be a non-empty message list"]),
        ([{"prompt": [{"role": "human", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}], ["row index 0: a message of 'prompt' has role 'human'; roles allowed: system, user"]),
    ],
)  # fmt: skip
def test_bad_rows_are_one_line(rows, words, tmp_path):
    path = _write(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(EffitrainError) as info:
        load_preference_data(TrainConfig(train_file=path))
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    if "row index" in message:
        assert path in message


def test_a_bad_row_through_the_cli(tmp_path, train_cli):
    from tests.conftest import assert_clean_error

    rows = [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 3
    rows[1] = {"prompt": "a", "chosen": " same", "rejected": " same"}
    path = _write(tmp_path / "pairs.jsonl", rows)
    result = train_cli("train", "--task", "preference", "--train-file", path)
    assert_clean_error(result, "row index 1: 'chosen' and 'rejected' are identical", path)


def test_validation_is_held_out_and_example_ids_are_stable(tmp_path, tokenizer):
    rows = [
        {"prompt": f"The board met on day {i}.", "chosen": f" It sold {i}.", "rejected": " No."}
        for i in range(30)
    ]
    path = _write(tmp_path / "pairs.jsonl", rows)
    config = TrainConfig(task="preference", train_file=path, batch_size=4)
    data = load_preference_data(config)
    assert (len(data.train), len(data.validation)) == (27, 3)
    assert data.validation_source == "10% held out of train"
    # the expected sequence of each example id: training rows first, then validation rows
    expected = {
        i: tokenize_pair(row, tokenizer, "explicit")
        for i, row in enumerate([*data.train, *data.validation])
    }
    seen = []
    for seed in (0, 1):
        train, evaluation = build_preference_dataloaders(
            data, tokenizer, dataclasses.replace(config, seed=seed)
        )
        order = []
        for loader in (train, evaluation):
            for batch in loader:
                pairs = len(batch["example"])
                for row, example in enumerate(batch["example"].tolist()):
                    ids = expected[example]
                    chosen = batch["input_ids"][row][batch["attention_mask"][row].bool()]
                    assert chosen.tolist() == ids["prompt_ids"] + ids["chosen_ids"]
                    rejected = batch["input_ids"][pairs + row][
                        batch["attention_mask"][pairs + row].bool()
                    ]
                    assert rejected.tolist() == ids["prompt_ids"] + ids["rejected_ids"]
                order.append(batch["example"].tolist())
        seen.append(order)
        assert sorted(sum(order, [])) == list(range(30))
        assert order[-1] == [27, 28, 29]  # evaluation: ordered, after the training ids
    assert seen[0] != seen[1]  # another seed shuffles, the ids stay with their pairs


def test_the_demo_pairs(tokenizer):
    from effitrain.demo.preference_pairs import (
        DEFAULT_NUM_TRAIN,
        DEFAULT_NUM_VALIDATION,
        build_demo_pairs,
    )

    demo = build_demo_pairs()
    assert (len(demo["train"]), len(demo["validation"])) == (
        DEFAULT_NUM_TRAIN,
        DEFAULT_NUM_VALIDATION,
    )
    assert demo["train"][:5] == build_demo_pairs()["train"][:5]  # deterministic
    assert not set(demo["validation"]["prompt"]) & set(demo["train"]["prompt"])
    rows = list(demo["train"]) + list(demo["validation"])
    assert all(row["chosen"] != row["rejected"] for row in rows)
    lengths = []
    for row in rows:
        ids = tokenize_pair(row, tokenizer, "explicit")
        lengths += [len(ids["prompt_ids"]) + len(ids[a]) for a in ("chosen_ids", "rejected_ids")]
        # every word is one the demo tokenizer knows: one token each (plus the period, eos)
        words = row["prompt"].replace(",", " ,").split() + row["chosen"].split()
        assert len(ids["prompt_ids"]) + len(ids["chosen_ids"]) <= len(words) + 3, row
    # nothing is cut at the default --max-length, and a run stays about a minute on a CPU
    assert max(lengths) <= TrainConfig().max_length // 2
    assert DEFAULT_NUM_TRAIN <= 1000


def test_the_demo_loads_as_the_task_default(tokenizer):
    data = load_preference_data(TrainConfig(task="preference"))
    assert data.format == "explicit" and data.source == "built-in demo preference pairs"
    assert data.validation_source == "split 'validation'"


# --- the task around the data ---


def test_the_task_is_registered_with_the_causal_lm_default_model():
    from effitrain.config import build_config
    from effitrain.tasks import TASKS, get_task
    from effitrain.tasks.preference import PreferenceTask

    assert isinstance(get_task("preference"), PreferenceTask) and "preference" in TASKS
    assert get_task("preference").speed_unit == "tokens"
    assert build_config(overrides={"task": "preference"}).model == "tiny-llama"


def test_preference_options_are_refused_under_other_tasks(train_cli):
    from tests.conftest import assert_clean_error

    proc = train_cli("train", "--task", "causal-lm", "--beta", "0.2")
    assert_clean_error(proc, "--beta needs --task preference (this run is causal-lm)")
    proc = train_cli("train", "--preference-loss", "orpo")
    assert_clean_error(proc, "--preference-loss needs --task preference")


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (("--packing",), ("--packing needs --task causal-lm (this run is preference)",)),
        (("--completion-only-loss",), ("--completion-only-loss needs --task causal-lm",)),
        (("--sample-prompt", "The board"), ("--sample-prompt needs --task causal-lm",)),
        (("--model", "tiny"), ("sequence-classification preset; for --task preference",)),
        (("--max-length", "1"), ("--max-length 1", "2 tokens")),
        (("--simpo-gamma", "1"), ("--simpo-gamma is for --preference-loss simpo",)),
        (
            ("--label-smoothing", "0.1", "--preference-loss", "orpo"),
            ("--label-smoothing is for --preference-loss dpo (this run is orpo)",),
        ),
        (("--label-smoothing", "0.5"), ("--label-smoothing must be from 0 to below 0.5",)),
        (("--beta", "0"), ("--beta must be greater than 0",)),
        # was a non-finite loss at step 1 blamed on the learning rate
        (("--beta", "1e308"), ("--beta must be greater than 0 and at most 1000 (got 1e+308)",)),
    ],
)
def test_option_refusals(train_cli, options, fragments):
    from tests.conftest import assert_clean_error

    assert_clean_error(train_cli("train", "--task", "preference", *options), *fragments)


def test_the_chunked_loss_lever_takes_preference():
    from effitrain import levers

    config = TrainConfig(task="preference", model="tiny-llama", chunked_loss="torch")
    levers.check_task(config, "preference")  # no refusal: the same decoder loss machinery
    with pytest.raises(EffitrainError, match="needs --task causal-lm or preference"):
        levers.check_task(config, "sequence-classification")


def test_the_fake_batch_is_a_preference_batch(tokenizer):
    from effitrain.tasks import get_task

    batch = get_task("preference").fake_batch(tokenizer, batch_size=3, length=10)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (6, 10)
    assert (batch["labels"][:, :5] == IGNORE_INDEX).all()
    assert (batch["labels"][:, 5:] == batch["input_ids"][:, 5:]).all()
    assert batch["example"].tolist() == [0, 1, 2]
    assert get_task("preference").fake_batch(None, 2, 4)["input_ids"].shape == (4, 4)


def test_the_data_line(tokenizer):
    from effitrain.tasks import get_task

    data = load_preference_data(TrainConfig(task="preference"))
    assert get_task("preference").data_line(data, None) == (
        "preference pairs (prompt/chosen/rejected), each a chosen and a rejected sequence, "
        "loss on the answers"
    )


def test_preference_tuning_of_pretrained_weights_defaults_to_a_lower_lr():
    """The fine-tuning (or LoRA) lr over the task's divisor (40), said in the banner's note;
    a preset (the demo, from scratch) and a given --lr are left alone."""
    from effitrain.build import resolve_hyperparameters
    from effitrain.config import TrainConfig
    from effitrain.tasks import get_task

    def lr(**values):
        result = resolve_hyperparameters(TrainConfig(**values), get_task(values["task"]))
        return result.lr, result.lr_note

    folder = {"model": "./my-sft-model"}
    fine, _ = lr(task="causal-lm", **folder)
    assert lr(task="preference", **folder) == (
        fine / 40,
        "adamw default for fine-tuning / 40 for preference tuning",
    )
    lora, _ = lr(task="causal-lm", lora_rank=8, **folder)
    assert lr(task="preference", lora_rank=8, **folder)[0] == lora / 40
    assert lr(task="preference", model="tiny-llama") == lr(task="causal-lm", model="tiny-llama")
    assert lr(task="preference", lr=1e-6, **folder) == (1e-6, "")
