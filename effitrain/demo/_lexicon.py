"""Word lists for the built-in demo task.

Every slot is a list of *meaning groups*; the strings inside one group are interchangeable
(synonyms), strings in different groups are not. A paraphrase (label 1) may swap any string
for another one of the same group; a non-paraphrase (label 0) moves every slot to a
*different* group (see ``_generate.py`` for why).

Each slot has only six meaning groups on purpose: a tiny transformer trained from scratch for
a few hundred steps learns a small vocabulary much faster (docs/architecture.md, the demo).

Verbs are chosen so that the simple past and the past participle are the same word, which
lets one string serve both "the committee approved the budget" and "the budget was approved
by the committee".
"""

from __future__ import annotations

Group = tuple[str, ...]

SUBJECTS: tuple[Group, ...] = (
    ("the committee", "the panel"),
    ("the company", "the firm"),
    ("the government", "the administration"),
    ("the board", "the directors"),
    ("the council",),
    ("the judge",),
)

VERBS: tuple[Group, ...] = (
    ("approved", "endorsed"),
    ("rejected", "turned down"),
    ("announced", "unveiled"),
    ("released", "published"),
    ("bought", "purchased", "acquired"),
    ("sold",),
)

NOUNS: tuple[Group, ...] = (
    ("budget",),
    ("plan", "proposal"),
    ("contract", "deal"),
    ("report", "study"),
    ("project",),
    ("policy",),
)

ADJECTIVES: tuple[Group, ...] = (
    ("new",),
    ("proposed", "planned"),
    ("controversial", "disputed"),
    ("final",),
    ("revised", "updated"),
    ("annual", "yearly"),
)

TIMES: tuple[Group, ...] = (
    ("on monday",),
    ("on tuesday",),
    ("on wednesday",),
    ("on thursday",),
    ("on friday",),
    ("on saturday",),
)

PLACES: tuple[Group, ...] = (
    ("in london",),
    ("in paris",),
    ("in new york",),
    ("in tokyo",),
    ("in berlin",),
    ("in sydney",),
)

CLAUSES: tuple[Group, ...] = (
    ("after a long debate", "following a lengthy debate"),
    ("despite strong opposition", "in spite of strong opposition"),
    ("without any warning", "with no warning"),
    ("for the second time",),
    ("amid growing concern", "amid rising concern"),
    ("by a narrow margin", "by a slim margin"),
)

#: slot name -> groups
SLOTS: dict[str, tuple[Group, ...]] = {
    "subject": SUBJECTS,
    "verb": VERBS,
    "noun": NOUNS,
    "adjective": ADJECTIVES,
    "time": TIMES,
    "place": PLACES,
    "clause": CLAUSES,
}

#: every word that occurs in a demo sentence, plus the few fixed function words
FUNCTION_WORDS: tuple[str, ...] = ("the", "was", "by", ",", ".")


def all_words() -> list[str]:
    """Sorted list of the distinct words used by the demo sentences."""
    words: set[str] = set(FUNCTION_WORDS)
    for groups in SLOTS.values():
        for group in groups:
            for phrase in group:
                words.update(phrase.split())
    return sorted(words)
