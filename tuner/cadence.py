"""When the workers of one host read it and react to it, so that they do not move in lockstep
(R4.12): pure functions of the worker's id, no clock of their own.

Workers of one host read the same host-wide figures (the free CPUs, the record). Read in the
same windows and acted on at the first reading, one change of the host (a neighbour leaves)
reaches every worker at once: all take the freed cores together, find them held, and all
give them back together. Two things keep them apart:

- **Phase and jitter** (``waits``): a worker's periodic reading starts at an offset of its
  period fixed by its id (``phase``), and each later wait is the period times 1 +/- ``JITTER``,
  drawn from a generator seeded by the id. Two workers whose readings fall in one window
  drift apart by a random walk (after k periods their offsets differ by about
  ``0.16 * sqrt(k)`` periods at ``JITTER`` 0.2): half a period within about ten.
- **Damping** (``react``): a worker changes what it does on a host reading only when
  ``AGREE`` of its own readings in a row say so, and then only after a delay of its own,
  drawn per worker and per change in [0, ``SPREAD_S``) (``delay_s``), while its readings
  go on agreeing; and never sooner than ``HOLD_S`` after its last change. Of the workers that
  saw one change of the host, the first to react changes what the others read before their
  own delay ends, and they stay as they are: one reacts, not all.

Deterministic per id: the same worker draws the same phase, waits and delays on every run,
so a test or a simulator replays it; two ids draw apart.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

# A fifth of a period: readings stay within 20% of their nominal spacing (a window's reading
# still comes about when the reader expects it), while two workers in step part within about
# ten periods (see the module docstring). A guess, not swept.
JITTER = 0.2
# Readings in a row that must agree before a worker reacts: one reading flips with a
# neighbour's burst of a window; three in a row (0.3 s at the tuner's 0.1-s windows) say the
# change lasts. A guess, not swept.
AGREE = 3
# The spread of the reaction delays: ten of the tuner's 0.1-s windows, so that of a few
# workers the first reaction usually shows in the others' readings (a window or two later)
# before their delay ends. A guess, not swept.
SPREAD_S = 1.0
# Least time between two changes of one worker: it does not flap faster than the effect of
# its change can be read (ten windows). A guess, not swept.
HOLD_S = 1.0


def _unit(*key: object) -> float:
    """A number in [0, 1) fixed by ``key``."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def phase(worker: str) -> float:
    """This worker's offset, as a fraction of a period in [0, 1)."""
    return _unit("phase", worker)


def waits(worker: str, period_s: float, jitter: float = JITTER) -> Iterator[float]:
    """The waits of a reading repeated every ``period_s``: first the worker's ``phase`` of a
    period, then periods of ``period_s * (1 +/- jitter)`` (uniform, seeded by the id)."""
    if period_s <= 0 or not 0 <= jitter < 1:
        raise ValueError(f"period_s must be positive and jitter in [0, 1), got {period_s}, "
                         f"{jitter}")
    draw = random.Random(_unit("waits", worker)).random
    yield phase(worker) * period_s
    while True:
        yield period_s * (1 + jitter * (2 * draw() - 1))


def delay_s(worker: str, changes: int, spread_s: float = SPREAD_S) -> float:
    """How long after the first of its agreeing readings the worker makes its next change
    (``changes`` made so far; at least ``AGREE`` readings must agree too): in
    [0, ``spread_s``), fixed by the id and the change's number."""
    return spread_s * _unit("delay", worker, changes)


@dataclass(frozen=True)
class Reaction:
    """A worker's reaction to one kind of host reading (e.g. "other tasks hold the cores a
    count needs"): whether it reacts now, and what decides when it may change."""

    on: bool = False
    disagreeing: int = 0  # its own readings in a row that said otherwise
    since_s: float = 0.0  # when the first of them came
    changed_at_s: float = float("-inf")
    changes: int = 0


def react(state: Reaction, reading: bool, now_s: float, worker: str, agree: int = AGREE,
          spread_s: float = SPREAD_S, hold_s: float = HOLD_S) -> Reaction:
    """The reaction after one more of the worker's own readings (``True``: react)."""
    if reading == state.on:
        return replace(state, disagreeing=0)
    since_s = now_s if state.disagreeing == 0 else state.since_s
    disagreeing = state.disagreeing + 1
    if (disagreeing < agree or now_s - state.changed_at_s < hold_s
            or now_s - since_s < delay_s(worker, state.changes, spread_s)):
        return replace(state, disagreeing=disagreeing, since_s=since_s)
    return Reaction(reading, 0, now_s, now_s, state.changes + 1)
