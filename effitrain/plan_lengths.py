"""The longest sequence length whose peak fits: a search over lengths for ``effitrain plan
--max-length longest``, on a grid of lengths a user would type. It asks a peak per length (the
plan's screens) and relies on one property: the peak grows with the length."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

FINE = 128
"""The grid's step below :data:`COARSE_FROM` tokens: a 1,024 step would lose up to an eighth
of a length of a few thousand tokens."""
COARSE = 1024
"""The grid's step from :data:`COARSE_FROM` tokens up: long contexts are typed in thousands of
1,024 (32,768, 131,072), and flash attention's tiles (64 to 256 tokens) divide them."""
COARSE_FROM = 16384
START = 4096
"""The first length tried."""
SHORTEST = FINE
"""Below this nothing is tried: "nothing fits"."""
FIRST_GROWTH = 4
"""The second length tried is this many times the first (a line needs two peaks)."""
MOST_GROWTH = 32
"""Until a length does not fit, the next is at most this many times the last: the line through
the last two peaks picks it, from a few thousand tokens out to hundreds of thousands (peaks are
near-linear in length; where they bend, the bracket that follows narrows it)."""


@dataclasses.dataclass(frozen=True)
class Found:
    """What the search found."""

    length: int | None
    """The longest length on the grid that fits (None: not even :data:`SHORTEST`)."""
    over: int | None
    """The next length on the grid, found not to fit (None: the search stopped at its cap)."""
    peaks: dict[int, int]
    """Each length tried, with its peak."""


def step_at(length: int) -> int:
    """The grid's step at ``length``."""
    return COARSE if length >= COARSE_FROM else FINE


def round_down(length: int) -> int:
    """The longest length on the grid at most ``length``."""
    return length // step_at(length) * step_at(length)


def next_on_grid(length: int) -> int:
    """The shortest length on the grid past ``length``."""
    return round_down(length) + step_at(length)


def longest_fitting(peak: Callable[[int], int], room: int, cap: int) -> Found:
    """The longest length on the grid, up to ``cap``, whose ``peak`` is at most ``room``.

    From :data:`START`, lengths grow along the line through the last two peaks until one does
    not fit (where the first does not, :data:`SHORTEST` is next: if it does not fit either,
    nothing does); the bracket then narrows where the line through its ends meets ``room``
    (peaks are near-linear in length: it lands within a step or two), the Illinois way where
    one end stays (its distance from ``room`` halved each time the other end moves again: a
    convex peak does not creep), until no grid length is left between the ends. ``cap`` need
    not be on the grid: it is tried itself where the grid would pass it.
    """
    peaks: dict[int, int] = {}
    fits: int | None = None  # the longest tried that fits
    over: int | None = None  # the shortest tried that does not
    weight = {True: 1.0, False: 1.0}  # each end's, by whether it fits
    moved: bool | None = None  # which end the last probe moved
    length = min(START, cap)
    while True:
        peaks[length] = peak(length)
        fitted = peaks[length] <= room
        if fitted:
            fits = length
        else:
            over = length
        weight[fitted] = 1.0
        if moved == fitted:
            weight[not fitted] /= 2
        moved = fitted
        if fits is None:
            if length <= SHORTEST:
                return Found(None, over, peaks)
            length = SHORTEST
            continue
        if fits >= cap:
            return Found(fits, None, peaks)
        if over is None:
            length = min(_grown(peaks, fits, room), cap)
            continue
        candidates = _between(fits, over)
        if not candidates:
            return Found(fits, over, peaks)
        below = (room - peaks[fits]) * weight[True]
        above = (peaks[over] - room) * weight[False]
        guess = fits + (over - fits) * below / (below + above)
        length = min(candidates, key=lambda c: abs(c - guess))


def _grown(peaks: dict[int, int], fits: int, room: int) -> int:
    """The next length to try above ``fits`` before any failed: the grid step just past where
    the line through the last two peaks meets ``room`` (on a line, the first length that does
    not fit: the bracket's upper end at once), at least the next grid step and at most
    :data:`MOST_GROWTH` times ``fits``."""
    below = [length for length in peaks if length < fits]
    if not below:
        return round_down(fits * FIRST_GROWTH)
    guess = next_on_grid(_on_line(max(below), fits, peaks, room))
    return max(next_on_grid(fits), min(guess, round_down(fits * MOST_GROWTH)))


def _on_line(a: int, b: int, peaks: dict[int, int], room: int) -> int:
    """Where the line through the peaks at ``a`` and ``b`` meets ``room``."""
    rise = peaks[b] - peaks[a]
    if rise <= 0:
        return 2 * b
    return int(a + (room - peaks[a]) * (b - a) / rise)


def _between(fits: int, over: int) -> list[int]:
    """The grid lengths strictly between ``fits`` and ``over``."""
    out = []
    length = next_on_grid(fits)
    while length < over:
        out.append(length)
        length += step_at(length)
    return out
