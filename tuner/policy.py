"""Thread-count decisions as small pure functions over timing samples (R4.5, R4.6).

A count is *learned* for a size range when every allowed count has ``min_samples`` timed
shadow passes there and it has the lowest median; a count other than the configured one must
beat the configured count's median by ``margin`` (noise on shared hosts is ~±30%, and
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


def learned_count(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
                  configured: int, min_samples: int, margin: float) -> int | None:
    """The fastest count for a range, or None while any count lacks samples."""
    if any(len(samples_by_count.get(n, ())) < min_samples for n in counts):
        return None
    medians = {n: float(np.median(samples_by_count[n])) for n in counts}
    best = min(counts, key=lambda n: (medians[n], n != configured, n))
    if best != configured and medians[best] > medians[configured] * (1 - margin):
        return configured
    return best


def speedup(samples_by_count: Mapping[int, Sequence[float]], configured: int,
            count: int) -> float | None:
    """Median time at the configured count over median time at ``count``."""
    a, b = samples_by_count.get(configured), samples_by_count.get(count)
    if not a or not b:
        return None
    return float(np.median(a) / np.median(b))


def counts_needing_samples(samples_by_count: Mapping[int, Sequence[float]],
                           counts: Sequence[int], target: int) -> list[int]:
    return [n for n in counts if len(samples_by_count.get(n, ())) < target]


def clean_window(busy_at_start: int, epoch_at_start: int, epoch_at_end: int) -> bool:
    """A shadow's time is a sample only if no served forward ran at any moment of it: none
    was running when it started and none started or ended before it finished (R4.5)."""
    return busy_at_start == 0 and epoch_at_start == epoch_at_end


def shadow_plan(need: Sequence[int], mode_serves: bool, learned: int | None,
                configured: int, serving: bool, served_at_learned: int,
                audit_every: int) -> list[int]:
    """Counts to run as shadows of one served batch: every count its range still lacks
    samples for; else mode 2's transition window (the learned count); else, every
    ``audit_every``-th served forward of a learned range, the configured count as an audit
    of a forward served at the learned count, or the learned count as a watch on its speed
    (R4.11) where it is not the one served."""
    if need:
        return list(need)
    if learned is None:
        return []
    if mode_serves and learned != configured and not serving:
        return [learned]
    if served_at_learned % audit_every:
        return []
    if serving:
        return [configured]
    return [learned] if learned != configured else []


def moved(recent_per_token: Sequence[float], baseline_per_token: float,
          factor: float) -> bool:
    """Forwards at the learned count now run ``factor`` slower or faster than that same count
    ran when it was learned (R4.11: never a comparison across counts)."""
    if not recent_per_token or baseline_per_token <= 0:
        return False
    ratio = float(np.median(recent_per_token)) / baseline_per_token
    return ratio > factor or ratio < 1 / factor
