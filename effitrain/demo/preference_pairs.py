"""The built-in offline preference demo: pairs of answers to a news report, one preferred.

Each row is TRL's explicit-prompt format: ``prompt`` is the lead sentence of a report in the
causal-LM demo corpus's style (``_lm_generate``), ``chosen`` is a follow-up sentence about the
same event, and ``rejected`` is a worse follow-up: either the same words in scrambled order
(ungrammatical), or a fluent one about another subject and object than the lead's (off topic).

Why this shape: every word is one the tiny-llama tokenizer (trained on that corpus) knows, so
sequences stay short; and a randomly initialised model that learns the corpus's word order
learns to prefer the chosen answer within a minute of DPO on a CPU. Validation reports are
about events that no training report is about.

Nothing here imports anything heavy; ``datasets`` is imported inside the function.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

from effitrain.demo._generate import random_style, render, sample_meaning
from effitrain.demo._lexicon import SLOTS
from effitrain.demo._lm_generate import _follow_ups as follow_ups

if TYPE_CHECKING:  # pragma: no cover
    import datasets

__all__ = ["DEFAULT_NUM_TRAIN", "DEFAULT_NUM_VALIDATION", "build_demo_pairs"]

DEFAULT_NUM_TRAIN = 1000
DEFAULT_NUM_VALIDATION = 200
SCRAMBLED_SHARE = 0.5
"""Share of pairs whose rejected answer is the chosen one's words scrambled (else off topic)."""


def _scrambled(sentence: str, rng: random.Random) -> str:
    """The sentence's words in another order (the final period kept last)."""
    words = sentence.rstrip(".").split()
    shuffled = list(words)
    while shuffled == words:
        rng.shuffle(shuffled)
    return " ".join(shuffled) + "."


def _off_topic(meaning: dict, rng: random.Random) -> dict:
    """The same event with another subject and object (so a follow-up names neither)."""
    other = dict(meaning)
    for slot in ("subject", "noun"):
        other[slot] = rng.choice([i for i in range(len(SLOTS[slot])) if i != meaning[slot]])
    return other


def _pair(meaning: dict, rng: random.Random) -> dict[str, str]:
    """One row: the lead sentence, a follow-up about it, and a worse follow-up."""
    prompt = render(meaning, random_style(rng))
    index = rng.randrange(2)  # the spokesperson's sentence or the critics' (both always there)
    chosen = [s for s in follow_ups(meaning, rng) if not s.startswith("The ")][index]
    if rng.random() < SCRAMBLED_SHARE:
        rejected = _scrambled(chosen, rng)
    else:
        rejected = [s for s in follow_ups(_off_topic(meaning, rng), rng) if s.startswith("A ")][0]
        if index == 1:  # the critics' sentence names no subject: go off topic with a spokesperson
            chosen = [s for s in follow_ups(meaning, rng) if s.startswith("A ")][0]
    return {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected}


@functools.lru_cache(maxsize=4)
def _pairs(
    seed: int, num_train: int, num_validation: int
) -> tuple[tuple[dict[str, str], ...], tuple[dict[str, str], ...]]:
    rng = random.Random(seed * 1_000_003 + 67)
    seen: set[tuple] = set()
    splits: list[list[dict[str, str]]] = [[], []]
    for split, size in ((0, num_train), (1, num_validation)):
        while len(splits[split]) < size:
            meaning = sample_meaning(rng)
            key = tuple(sorted(meaning.items()))
            if key in seen:  # one pair per event: no validation event in train
                continue
            seen.add(key)
            splits[split].append(_pair(meaning, rng))
    return tuple(splits[0]), tuple(splits[1])


def build_demo_pairs(
    seed: int = 0,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_validation: int = DEFAULT_NUM_VALIDATION,
) -> datasets.DatasetDict:
    """The demo preference pairs: splits ``train`` and ``validation``, string columns
    ``prompt``, ``chosen`` and ``rejected`` (answers start with a space, as TRL's examples do).

    Fully determined by the arguments (its own ``random.Random``, never the global RNG).
    """
    import datasets

    if num_train < 1 or num_validation < 1:
        raise ValueError("num_train and num_validation must be at least 1")
    train, validation = _pairs(seed, num_train, num_validation)
    columns = ("prompt", "chosen", "rejected")
    features = datasets.Features({c: datasets.Value("string") for c in columns})

    def split(rows: tuple[dict[str, str], ...]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {c: [row[c] for row in rows] for c in columns}, features=features
        )

    return datasets.DatasetDict({"train": split(train), "validation": split(validation)})
