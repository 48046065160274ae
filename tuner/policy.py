"""Thread-count decisions as small pure functions over timing samples (R4.5, R4.6).

A count is *learned* for a size range when every allowed count has ``min_samples`` timed
shadow passes there (or, after its first few, already runs twice as slow as the best) and it
has the lowest ``typical`` time (lower quartile); a count other than the configured one must
beat the configured count's by ``margin`` (noise on shared hosts is ~±30%, and
switching costs a transition window), else the configured count stays.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class RangeState(enum.StrEnum):
    LOCKED = "locked-before-golden"
    EXPLORING = "exploring"
    LEARNED = "learned"
    VERIFYING = "verifying"  # mode 2: learned, inside its transition window
    SERVING = "serving-learned"
    NO_VOUCHER = "no-voucher"  # mode 2 without a voucher acts as mode 1
    RETIRED = "retired-by-drift"
    RELEARNING = "relearning"


@dataclass(frozen=True)
class Summary:
    median_ms: float
    p90_ms: float
    samples: int


def summarize(samples_ms: Sequence[float]) -> Summary | None:
    if not samples_ms:
        return None
    arr = np.asarray(samples_ms, dtype=np.float64)
    return Summary(float(np.median(arr)), float(np.percentile(arr, 90)), len(arr))


def typical(samples_ms: Sequence[float]) -> float:
    """How fast a count runs when the host lets it: the lower quartile of its samples. A
    neighbour that comes and goes slows some samples of a count above 1 by 2x and more; the
    median of such a mix says how often it was there, and a count learned on it (1 thread
    here, the whole time) loses the quiet stretches, while contention is followed apart
    (mode 2 serves a count below while the learned one runs slow)."""
    return float(np.percentile(np.asarray(samples_ms, dtype=np.float64), 25))


def losing_counts(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
                  early: int, factor: float) -> set[int]:
    """Counts whose first ``early`` samples, even the fastest, already run ``factor`` times
    slower than the best count's typical time: they need no more samples (an oversubscribed
    count's shadows are long and rarely fit between served forwards). One fast sample keeps a
    count in (the first forwards at a new count can be cold)."""
    have = {n: samples_by_count[n] for n in counts if len(samples_by_count.get(n, ())) >= early}
    if len(have) < 2:
        return set()
    best = min(typical(v) for v in have.values())
    return {n for n, v in have.items() if min(v) > factor * best}


def learned_count(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
                  configured: int, min_samples: int, margin: float, early: int = 3,
                  losing: float = 2.0) -> int | None:
    """The fastest count for a range, or None while any count still lacks samples (a count
    ``losing_counts`` puts out needs no more)."""
    out = losing_counts(samples_by_count, counts, early, losing)
    if counts_needing_samples(samples_by_count, counts, min_samples, early, losing):
        return None
    ms = {n: typical(samples_by_count[n]) for n in counts}
    best = min((n for n in counts if n not in out), key=lambda n: (ms[n], n != configured, n))
    if best != configured and ms[best] > ms[configured] * (1 - margin):
        return configured
    return best


def speedup(samples_by_count: Mapping[int, Sequence[float]], configured: int,
            count: int) -> float | None:
    """Typical time at the configured count over typical time at ``count``."""
    a, b = samples_by_count.get(configured), samples_by_count.get(count)
    if not a or not b:
        return None
    return typical(a) / typical(b)


def counts_needing_samples(samples_by_count: Mapping[int, Sequence[float]],
                           counts: Sequence[int], target: int, early: int = 3,
                           losing: float = 2.0) -> list[int]:
    out = losing_counts(samples_by_count, counts, early, losing)
    return [n for n in counts if len(samples_by_count.get(n, ())) < target and n not in out]


def clean_window(busy_at_start: int, epoch_at_start: int, epoch_at_end: int) -> bool:
    """A shadow's time is a sample only if no served forward ran at any moment of it: none
    was running when it started and none started or ended before it finished (R4.5)."""
    return busy_at_start == 0 and epoch_at_start == epoch_at_end


def likely_uninterrupted(gaps_s: Sequence[float], idle_s: float, need_s: float,
                         share: float = 0.5, evidence: int = 4) -> bool:
    """Whether a shadow of ``need_s`` started now, ``idle_s`` after the last served forward
    ended, would likely end before the next one starts: of the recent idle gaps between served
    forwards that lasted ``idle_s``, at least ``share`` lasted ``idle_s + need_s`` (with fewer
    than ``evidence`` such gaps, nothing says it would not). Under closed-loop load every gap
    is the client's turnaround, shorter than any shadow: none starts, where each would only
    have been frozen and thrown away; under Poisson arrivals most gaps are long enough."""
    lasted = [g for g in gaps_s if g >= idle_s]
    if len(lasted) < evidence:
        return True
    return sum(g >= idle_s + need_s for g in lasted) >= share * len(lasted)


def preempted(forward_s: float, waited_s: float | None, share: float = 0.1,
              floor_s: float = 1e-4) -> bool:
    """A shadow's threads waited for a CPU another task held for more than ``share`` of its
    time (plus ``floor_s`` of wake-up latency): its time says how busy the host was, not how
    fast the count is, so it is not a sample (R4.5). An idle-class shadow loses its CPU to
    any task of any other class (the frontend, a neighbour, another worker) and a count above
    1 stalls on its slowest thread: such samples made 2 threads look 3-100x slower than 1."""
    return waited_s is not None and waited_s > share * forward_s + floor_s


def shadow_plan(need: Sequence[int], window_due: bool, learned: int | None,
                served: int, counts: Sequence[int], served_at_learned: int,
                probe_every: int) -> list[int]:
    """Counts to run as shadows of one served batch: every count its range still lacks
    samples for; else mode 2's transition window (the learned count); else, every
    ``probe_every``-th forward of a learned range, one count other than the served one, in
    turn: a probe of its time (R4.11) and, in mode 2, an audit of the served answer."""
    if need:
        return list(need)
    if learned is None:
        return []
    if window_due:
        return [learned]
    others = [n for n in counts if n != served]
    if not others or served_at_learned % probe_every:
        return []
    return [others[(served_at_learned // probe_every) % len(others)]]


def moved(recent_per_token: Sequence[float], baseline_per_token: float,
          factor: float) -> bool:
    """Forwards at one count now run ``factor`` slower or faster than that same count ran when
    the range was learned (R4.11: never a comparison across counts)."""
    if not recent_per_token or baseline_per_token <= 0:
        return False
    ratio = float(np.median(recent_per_token)) / baseline_per_token
    return ratio > factor or ratio < 1 / factor
