"""Word lists for the built-in demo task.

Every slot is a list of *meaning groups*; the strings inside one group are interchangeable
(synonyms), strings in different groups are not. A paraphrase (label 1) may swap any string
for another one of the same group; a non-paraphrase (label 0) replaces exactly one slot by a
string from a *different* group.

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
    ("the bank", "the lender"),
    ("the police",),
    ("the university", "the college"),
    ("the minister",),
    ("the union",),
    ("the hospital", "the clinic"),
    ("the mayor",),
    ("the court", "the tribunal"),
    ("the agency",),
    ("the investors", "the shareholders"),
    ("the senator",),
    ("the school",),
    ("the airline", "the carrier"),
    ("the president",),
)

VERBS: tuple[Group, ...] = (
    ("approved", "endorsed"),
    ("rejected", "turned down"),
    ("announced", "unveiled"),
    ("released", "published"),
    ("bought", "purchased", "acquired"),
    ("sold",),
    ("cancelled", "called off"),
    ("delayed", "postponed"),
    ("reviewed", "examined"),
    ("criticized", "condemned"),
    ("signed",),
    ("launched", "started"),
    ("closed", "shut"),
    ("funded", "financed"),
    ("expanded",),
    ("blocked",),
    ("supported", "backed"),
    ("changed", "modified"),
    ("questioned", "challenged"),
    ("praised",),
    ("completed", "finished"),
    ("defended",),
)

NOUNS: tuple[Group, ...] = (
    ("budget",),
    ("plan", "proposal"),
    ("contract", "deal"),
    ("report", "study"),
    ("project",),
    ("policy",),
    ("merger",),
    ("agreement", "accord"),
    ("offer", "bid"),
    ("strategy",),
    ("inquiry", "investigation"),
    ("factory", "plant"),
    ("loan",),
    ("tax",),
    ("website",),
    ("product",),
    ("drug", "medicine"),
    ("system",),
    ("schedule", "timetable"),
    ("program", "scheme"),
    ("reform", "overhaul"),
    ("law",),
)

ADJECTIVES: tuple[Group, ...] = (
    ("new",),
    ("proposed", "planned"),
    ("controversial", "disputed"),
    ("final",),
    ("revised", "updated"),
    ("annual", "yearly"),
    ("large", "big"),
    ("small",),
    ("national",),
    ("local",),
    ("secret", "confidential"),
    ("expensive", "costly"),
    ("major", "significant"),
    ("joint",),
    ("public",),
    ("private",),
    ("temporary",),
    ("ambitious",),
)

TIMES: tuple[Group, ...] = (
    ("on monday",),
    ("on tuesday",),
    ("on wednesday",),
    ("on thursday",),
    ("on friday",),
    ("on saturday",),
    ("on sunday",),
    ("yesterday",),
    ("last week", "the previous week"),
    ("last month", "the previous month"),
    ("last year", "the previous year"),
    ("earlier this year",),
    ("in january",),
    ("in march",),
    ("in may",),
    ("in june",),
    ("in september",),
    ("in november",),
)

PLACES: tuple[Group, ...] = (
    ("in london",),
    ("in paris",),
    ("in new york",),
    ("in tokyo",),
    ("in berlin",),
    ("in sydney",),
    ("in chicago",),
    ("in boston",),
    ("in madrid",),
    ("in toronto",),
    ("in rome",),
    ("in washington",),
)

CLAUSES: tuple[Group, ...] = (
    ("after a long debate", "following a lengthy debate"),
    ("despite strong opposition", "in spite of strong opposition"),
    ("without any warning", "with no warning"),
    ("for the second time",),
    ("amid growing concern", "amid rising concern"),
    ("by a narrow margin", "by a slim margin"),
    ("behind closed doors", "in private"),
    ("under heavy pressure",),
)

#: slot name -> groups; the order is the order slots are considered for a replacement
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
