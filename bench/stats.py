"""Ratios with intervals, and verdicts that count a target as met only when its interval clears
it (SPEC R8.2). Pure functions over plain numbers: no servers, no clocks.

A bench round runs every server once, close together in time, with the same requests at the
same times; a *paired ratio* is one server's figure over another's in the same round, so the
host's drift between rounds cancels. The rounds are the unit of resampling: a percentile
bootstrap (fixed seed, so one run's report is reproducible) resamples whole rounds with
replacement and recomputes the statistic, the median of the paired ratios or a ratio of
figures pooled over the rounds (a p99 over all the requests of the resampled rounds).
"""

from __future__ import annotations

import math
import operator
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

RESAMPLES = 2000  # the interval's ends move by well under 1% between seeds at this count
LEVEL = 0.95
# Fewer rounds than this give no verdict: a percentile bootstrap of n rounds never reaches past
# their extremes, and the true median lies outside them with chance 2 * 0.5**n (6% at 5 rounds,
# 3% at 6), so below 6 rounds a "95%" interval cannot hold 95%.
MIN_ROUNDS = 6
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Interval:
    """A statistic over ``rounds`` rounds with its bootstrap interval [lo, hi]."""
    estimate: float
    lo: float
    hi: float
    rounds: int

    def text(self) -> str:
        if not math.isfinite(self.estimate):
            return "n/a"
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return f"{self.estimate:.3f} (no interval: {self.rounds} round)"
        return f"{self.estimate:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


NONE = Interval(math.nan, math.nan, math.nan, 0)


@dataclass(frozen=True)
class Goal:
    """A target on a ratio: ``op value``, e.g. ``>= 0.97``."""
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Goal:
        op, _, value = text.strip().partition(" ")
        if op not in _OPS:
            raise ValueError(f"goal {text!r}: the operator must be one of {sorted(_OPS)}")
        try:
            return cls(op, float(value))
        except ValueError:
            raise ValueError(f"goal {text!r}: {value!r} is not a number") from None

    def holds(self, x: float) -> bool:
        return _OPS[self.op](x, self.value)

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """Round by round ``a[i] / b[i]``; a round where either figure is missing, not finite or
    ``b`` is not positive is left out."""
    return [x / y for x, y in zip(a, b, strict=False)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
            and y > 0]


def bootstrap(rounds: Sequence[T], statistic: Callable[[Sequence[T]], float],
              level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """``statistic`` over ``rounds`` and its percentile-bootstrap interval: ``resamples``
    draws of len(rounds) rounds with replacement. Fewer than two rounds: no interval (the
    estimate alone, lo and hi NaN)."""
    n = len(rounds)
    if n == 0:
        return NONE
    estimate = statistic(rounds)
    if n < 2:
        return Interval(estimate, math.nan, math.nan, n)
    rng = random.Random(seed)
    draws = sorted(statistic([rounds[rng.randrange(n)] for _ in range(n)])
                   for _ in range(resamples))
    tail = (1 - level) / 2
    lo = draws[max(0, math.floor(tail * resamples))]
    hi = draws[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    return Interval(estimate, lo, hi, n)


def median_interval(values: Sequence[float], **kw) -> Interval:
    """The median of per-round values (paired ratios) with its bootstrap interval."""
    return bootstrap(list(values), statistics.median, **kw)


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (the load generator's own rule); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(pct / 100 * len(s)) - 1))]


def pooled_ratio_interval(a_rounds: Sequence[Sequence[float]],
                          b_rounds: Sequence[Sequence[float]],
                          pooled: Callable[[list[float]], float], **kw) -> Interval:
    """``pooled(a's values of all rounds) / pooled(b's)``, e.g. the p99 of every request of
    every round, with a bootstrap over paired rounds (a drawn round takes both servers' values
    of that round)."""
    pairs = [(a, b) for a, b in zip(a_rounds, b_rounds, strict=False) if a and b]

    def stat(drawn: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
        num = pooled([v for a, _ in drawn for v in a])
        den = pooled([v for _, b in drawn for v in b])
        return num / den if den > 0 else math.nan

    return bootstrap(pairs, stat, **kw)


def sum_ratio_interval(a: Sequence[float], b: Sequence[float], **kw) -> Interval:
    """``sum(a) / sum(b)`` over paired rounds (totals: served seconds, requests) with its
    bootstrap interval."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False)
             if math.isfinite(x) and math.isfinite(y)]

    def stat(drawn: Sequence[tuple[float, float]]) -> float:
        den = sum(y for _, y in drawn)
        return sum(x for x, _ in drawn) / den if den > 0 else math.nan

    return bootstrap(pairs, stat, **kw)


def verdict(interval: Interval, goal: Goal) -> str:
    """"met" when the whole interval meets the goal, "missed" when none of it does,
    "unresolved" otherwise, and always with fewer than ``MIN_ROUNDS`` rounds."""
    if interval.rounds < MIN_ROUNDS or not (math.isfinite(interval.lo)
                                            and math.isfinite(interval.hi)):
        return "unresolved"
    ends = (goal.holds(interval.lo), goal.holds(interval.hi))
    return "met" if all(ends) else "missed" if not any(ends) else "unresolved"
