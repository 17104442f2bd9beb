"""Deterministic generator of MRPC-shaped sentence pairs (pure Python, no heavy imports).

A *meaning* is a choice of one meaning group per slot (subject, verb, noun, and optionally
adjective, time, place, clause). A sentence renders a meaning with a random choice of
synonyms, active or passive voice, and a fronted or trailing time phrase or clause.

- label 1 (equivalent): sentence2 renders the *same* meaning as sentence1, restyled (each
  choice of synonym, voice and fronted phrase is redrawn with probability ``STYLE``), so the
  two often differ on the surface; sometimes they are word-for-word identical.
- label 0 (not_equivalent): sentence2 reports a *different* event of the same shape (every
  present slot moved to another meaning group), restyled from sentence1 in the same way, so
  style and sentence shape tell nothing about the label.

Every sentence on its own is a plausible sentence of either label: only comparing the two
sentences (content words, modulo synonyms) tells the labels apart.

Why not MRPC's harder negatives (one word changed)? The tiny preset, trained from scratch within
the demo's time budget, does not learn them (docs/architecture.md, the demo). The demo has to
show a loss that falls and an accuracy that rises within seconds on a laptop CPU, with every
optimizer, so it takes the learnable version.
"""

from __future__ import annotations

import random

from effitrain.demo._lexicon import SLOTS

Meaning = dict[str, int | None]

#: probability that an optional slot is present in a meaning
_OPTIONAL = {"adjective": 0.6, "time": 0.7, "place": 0.35, "clause": 0.3}
#: how sentence2 is restyled from sentence1 (the same way for both labels): the chance that a
#: slot switches to another synonym, that the voice flips, that a different phrase is fronted
STYLE = {"synonym": 0.15, "passive": 0.15, "front": 0.15}
#: words capitalized inside time and place phrases
_PROPER = {
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
    "london", "paris", "new", "york", "tokyo", "berlin", "sydney",
}  # fmt: skip


def sample_meaning(rng: random.Random) -> Meaning:
    """A random meaning: a group per slot, optional slots absent (None) by chance."""
    meaning: Meaning = {}
    for slot, groups in SLOTS.items():
        if slot in _OPTIONAL and rng.random() >= _OPTIONAL[slot]:
            meaning[slot] = None
        else:
            meaning[slot] = rng.randrange(len(groups))
    return meaning


def _perturb(meaning: Meaning, rng: random.Random) -> Meaning:
    """Another event of the same shape: every present slot moves to a different group."""
    return {
        slot: None
        if value is None
        else rng.choice([i for i in range(len(SLOTS[slot])) if i != value])
        for slot, value in meaning.items()
    }


def _proper_case(phrase: str) -> str:
    return " ".join(w.capitalize() if w in _PROPER else w for w in phrase.split())


Style = dict  # {"form": {slot: index in group}, "passive": bool, "front": "time" | "clause" | None}


def random_style(rng: random.Random) -> Style:
    """A random choice of synonyms, voice and fronted phrase."""
    return {
        "form": {slot: rng.randrange(3) for slot in SLOTS},
        "passive": rng.random() < 0.5,
        "front": rng.choice(("time", "clause")) if rng.random() < 0.4 else None,
    }


def _restyle(style: Style, rng: random.Random) -> Style:
    """The style of sentence2: sentence1's, with some choices redrawn (``STYLE``)."""
    form = {
        slot: (index + 1 + rng.randrange(2)) % 3 if rng.random() < STYLE["synonym"] else index
        for slot, index in style["form"].items()
    }
    passive = not style["passive"] if rng.random() < STYLE["passive"] else style["passive"]
    front = style["front"]
    if rng.random() < STYLE["front"]:
        front = rng.choice([f for f in ("time", "clause", None) if f != front])
    return {"form": form, "passive": passive, "front": front}


def render(meaning: Meaning, style: Style) -> str:
    """The sentence that says ``meaning`` in ``style``."""
    word = {
        slot: (
            SLOTS[slot][value][style["form"][slot] % len(SLOTS[slot][value])]
            if value is not None
            else None
        )
        for slot, value in meaning.items()
    }
    obj = "the " + (f"{word['adjective']} " if word["adjective"] else "") + word["noun"]
    if style["passive"]:
        core = [obj, "was", word["verb"], "by", word["subject"]]
    else:
        core = [word["subject"], word["verb"], obj]

    tail = []
    if word["place"]:
        tail.append(_proper_case(word["place"]))
    time = _proper_case(word["time"]) if word["time"] else None
    clause = word["clause"]
    # at most one phrase moves to the front, MRPC-style: "On Monday, the committee ..."
    fronted = {"time": time, "clause": clause, None: None}[style["front"]]
    for phrase in (time, clause):
        if phrase and phrase != fronted:
            tail.append(phrase)

    text = " ".join(core + tail)
    if fronted:
        text = f"{fronted}, {text}"
    return text[0].upper() + text[1:] + "."


def _key(meaning: Meaning) -> tuple:
    return tuple(sorted(meaning.items()))


def generate_pairs(
    rng: random.Random,
    n: int,
    *,
    exclude_pairs: set[tuple[str, str]] | None = None,
    exclude_meanings: set[tuple] | None = None,
) -> tuple[list[tuple[str, str, int]], set[tuple]]:
    """``n`` distinct (sentence1, sentence2, label) triples, exactly half of each label
    (label 1 gets the extra one when ``n`` is odd), in shuffled order.

    Pairs in ``exclude_pairs`` and sentence1 meanings in ``exclude_meanings`` are never
    produced. Returns the triples and the set of sentence1 meanings used.
    """
    exclude_pairs = exclude_pairs or set()
    exclude_meanings = exclude_meanings or set()
    labels = [1] * (n - n // 2) + [0] * (n // 2)
    rng.shuffle(labels)
    seen: set[tuple[str, str]] = set()
    meanings: set[tuple] = set()
    out: list[tuple[str, str, int]] = []
    for label in labels:
        while True:
            meaning = sample_meaning(rng)
            if _key(meaning) in exclude_meanings:
                continue
            other = meaning if label == 1 else _perturb(meaning, rng)
            style = random_style(rng)
            s1, s2 = render(meaning, style), render(other, _restyle(style, rng))
            if (s1, s2) in seen or (s1, s2) in exclude_pairs:
                continue
            break
        seen.add((s1, s2))
        meanings.add(_key(meaning))
        out.append((s1, s2, label))
    return out, meanings
