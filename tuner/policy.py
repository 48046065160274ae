"""When a shadow's time is a sample, which shadows a served batch gets and which count a
vouched exploring range serves, as small pure functions (R4.5, R4.6, R4.8); the estimate and
the choice of a learned count are ``estimator``'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_srun.tuner.estimator import EARLY, typical

# the report's vocabulary of range states lives with the state machine (``ranges``)
from vllm_srun.tuner.ranges import RangeState


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

def explore_count(samples: Mapping[int, Sequence[float]], counts: Sequence[int], serving: int,
                  need: Sequence[int], vouched: Callable[[int], bool]) -> int:
    """The count a vouched exploring range serves next: of those it ``need``s now, the ones
    on the frontier (every allowed count between it and ``serving`` has its first ``EARLY``
    samples: exploring outward lets ``estimator.past_a_slower_count`` spare the far counts),
    the one with the fewest samples (ties: the one nearest the count it serves); when it may
    time none now (other tasks hold their cores), the ``vouched`` count fastest so far
    (``serving`` before any has a few samples)."""
    if not need:
        known = [n for n in counts if len(samples.get(n, ())) >= 3 and vouched(n)]
        return min(known, key=lambda n: (typical(samples[n]), n != serving, n)) \
            if known else serving
    front = [n for n in need if all(len(samples.get(k, ())) >= EARLY for k in counts
                                    if min(n, serving) < k < max(n, serving))]
    return min(front or need, key=lambda n: (len(samples.get(n, ())),
                                             abs(n.bit_length() - serving.bit_length()), n))


__all__ = ["RangeState", "Summary", "clean_window", "explore_count", "likely_uninterrupted",
           "preempted",
           "shadow_plan", "summarize"]
