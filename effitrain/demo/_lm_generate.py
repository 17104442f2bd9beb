"""Deterministic generator of the causal-LM demo's documents (pure Python, no heavy imports).

A document is a short news report of two to four sentences. The first sentence reports an
event in the classification demo's style (``_generate.render``: who did what to what, and
maybe when, where and how); the sentences after it pick up that event: a spokesperson of the
same subject on the same object, a vote count, a price, a reaction, a date for what comes next.

Why this shape: a tiny model trained from scratch for a minute learns it visibly. The lead
sentence has a small vocabulary and a fixed grammar (fast to learn), and the follow-ups repeat
the lead's subject and object, so a model that has learned to look back in its context predicts
them where one that has not cannot.
"""

from __future__ import annotations

import random

from effitrain.demo._generate import random_style, render, sample_meaning
from effitrain.demo._lexicon import SLOTS

_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_QUOTES = (
    "would take effect next month",
    "had been expected for weeks",
    "would be reviewed next year",
    "was the result of months of work",
    "was good news for the city",
)
_REACTIONS = (
    "long overdue",
    "a mistake",
    "a step in the right direction",
    "premature",
    "unexpected",
)
_CRITICS = ("Critics", "Supporters", "Analysts", "Local residents")
_ORDINALS = ("first", "second", "third")
#: a few round prices: spread over a wide range, each is too rare to learn and a greedy sample
#: stutters ("worth worth worth ...") instead of naming one (docs/causal-lm.md)
_PRICES = (5, 10, 15, 20, 25, 30, 40, 50)
#: verb groups (indexes into ``SLOTS["verb"]``) that follow a vote, and that involve a price
_VOTED = {0, 1}
_PRICED = {4, 5}


def _word(slot: str, meaning: dict, rng: random.Random) -> str:
    """One synonym of the meaning's word for ``slot`` (redrawn: follow-ups vary their wording)."""
    return rng.choice(SLOTS[slot][meaning[slot]])


def _follow_ups(meaning: dict, rng: random.Random) -> list[str]:
    """The sentences that may follow the lead sentence, in report order."""
    subject = _word("subject", meaning, rng)
    noun = _word("noun", meaning, rng)
    sentences = []
    if meaning["verb"] in _VOTED:
        high = rng.randrange(4, 10)
        sentences.append(f"The vote was {high} to {rng.randrange(1, high)}.")
    if meaning["verb"] in _PRICED:
        sentences.append(f"The {noun} is worth {rng.choice(_PRICES)} million dollars.")
    sentences.append(f"A spokesperson for {subject} said the {noun} {rng.choice(_QUOTES)}.")
    sentences.append(f"{rng.choice(_CRITICS)} said the decision was {rng.choice(_REACTIONS)}.")
    if rng.random() < 0.5:
        sentences.append(f"It was the {rng.choice(_ORDINALS)} such decision this year.")
    else:
        sentences.append(f"{subject.capitalize()} will meet again on {rng.choice(_DAYS)}.")
    return sentences


def _meaning_key(meaning: dict) -> tuple:
    return tuple(sorted(meaning.items()))


def generate_documents(
    rng: random.Random, n: int, *, exclude_meanings: set[tuple] | None = None
) -> tuple[list[str], set[tuple]]:
    """``n`` distinct documents, and the set of lead-sentence meanings they report.

    Documents whose lead sentence reports a meaning in ``exclude_meanings`` are never produced,
    so a validation set built with the training meanings excluded reports only new events.
    """
    exclude_meanings = exclude_meanings or set()
    seen: set[str] = set()
    meanings: set[tuple] = set()
    out: list[str] = []
    while len(out) < n:
        meaning = sample_meaning(rng)
        key = _meaning_key(meaning)
        if key in exclude_meanings:
            continue
        follow = _follow_ups(meaning, rng)
        # two to four sentences: the lead, then the first one to three follow-ups, in order
        keep = rng.randrange(1, min(3, len(follow)) + 1)
        text = " ".join([render(meaning, random_style(rng)), *follow[:keep]])
        if text in seen:
            continue
        seen.add(text)
        meanings.add(key)
        out.append(text)
    return out, meanings
