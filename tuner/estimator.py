"""Forward time per (range, count) (R4.5, R4.11): the statistic, the rule that chooses a
count and the change detector, pure functions over timing samples; no clock, no lock, no state.
What a served forward or a shadow says of a count, a sample, is ``samples``: a forward of its
range's smallest size at that count with its cores free.

The statistic: the **median** of a count's most recent samples in its range (the caller keeps
the last ``max_samples``: that is the horizon), with an order-statistic interval of about 80%
confidence (``estimate``).

The rule (``choose``): once every allowed count has ``min_samples`` or is ruled out
(``ruled_out``: it lost early, its interval already wholly above the interval of the count
fastest so far; or it lies past a slower count, below), each other count is judged against
the configured count's median less ``margin`` (the bar): sure faster where its whole interval
lies under the bar, sure not where its whole interval lies at or over it. While any count's
interval straddles the bar, the rule is not sure: those counts and the configured one take
more samples, up to the ``most`` a decision rests on (``max_samples``, the horizon), where the
medians decide. Then the count with the lowest median under the bar replaces the configured
one; with none under it, the configured count stays. Deciding for the configured count at
``min_samples`` whenever an interval reached over the bar kept 1 thread under steady
closed-loop load in 1-4 of 6 ranges a round, where fixed 2 threads served 1.3-1.5x the
requests of fixed 1 (``bench/results/adaptive_load_steady_vouched_loadfactor.json``); deciding
for it as soon as the faster count's median lay over the bar (its interval reaching under)
kept it, on samples spread +-30% as served forwards are beside 16 closed-loop clients, where
the other count ran 1.15x faster in 2 draws of 5 (``tests/test_estimator.py``). A flat range
takes its 48 samples of each count (the counts cost the same, so exploring loses little).

The change detector (``changed``): the median of recent forwards at one count moved by
``factor`` either way from that same count's estimate when the range was learned (R4.11:
like against like, so a large speed-up never triggers it).

Past a slower count (``past_a_slower_count``): forward time is unimodal in the count (it
falls while more threads share the work, then rises as their synchronisation and the cores'
shared caches and memory cost more than the split saves: FACTS.md's tables; the 16-core
Xeon's, ``bench/results/precision_xeon16.json``), so once a count's first ``EARLY`` samples
all ran slower than the fastest count's median, every count beyond it, on the far side from
the fastest, is slower still and is not timed. Exploring outward from the count served
(``policy.explore_count``) lets that rule spare the far counts: on a simulated 16-core host,
each range timed 1 and 2 threads a dozen times each at up to 8x the cost of its best count
(``bench/moving_best.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# the interval's two-sided confidence is about 80%: the ranks of the median's order-statistic
# interval lie this many standard deviations of Binomial(n, 1/2) either side of n/2. Not 90%
# (1.645): at 6 samples a 90% interval is the whole range, so one slow sample of a count
# (a preemption) kept it from replacing a configured count 1.3x slower (real L3, 1 vs 2
# threads, one run); at 12 samples both pick the same ranks
Z_80 = 1.2816
# a count is judged (``losing_counts``, ``past_a_slower_count``) once it has this many
# samples: at three the ~80% interval is every sample, so one fast sample keeps it in (the
# first at a new count may be cold)
EARLY = 3


@dataclass(frozen=True)
class Estimate:
    """A count's forward time in a range: the median and its ~80% interval, in ms."""

    ms: float
    low_ms: float
    high_ms: float
    samples: int


def estimate(samples_ms: Sequence[float]) -> Estimate | None:
    """The median of ``samples_ms`` and its order-statistic interval (ranks n/2 -+
    ``Z_80`` * sqrt(n)/2, clipped to the samples); None without samples."""
    if not samples_ms:
        return None
    s = sorted(samples_ms)
    n = len(s)
    half = Z_80 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half) - 1)
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return Estimate(_median(s), s[lo], s[hi], n)


def _median(s: Sequence[float]) -> float:
    """The median of sorted ``s`` (as ``np.median``; on a few dozen samples, without its
    overhead: the learner reads medians on each served forward it explores on)."""
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def typical(samples_ms: Sequence[float]) -> float:
    """The statistic counts are compared by: the median (``estimate``)."""
    return _median(sorted(samples_ms))


def losing_counts(samples_by_count: Mapping[int, Sequence[float]],
                  counts: Sequence[int]) -> set[int]:
    """Counts that cannot win: of those with ``EARLY`` samples or more, each whose interval
    (``estimate``) lies wholly above the interval of the one with the lowest median. At
    three samples that is all of them above all of the fastest count's (a count as fast
    comes out so one time in twenty, and loses nothing by it); the interval, not a fixed
    ratio, so the host's noise sets how far behind is sure: a fixed 2x let counts 1.4x
    slower take their twelve samples in every range (served forwards at up to 1.5x the
    cost of the best count, a simulated 16-core host: ``bench/moving_best.py``)."""
    est = {n: estimate(samples_by_count[n]) for n in counts
           if len(samples_by_count.get(n, ())) >= EARLY}
    if len(est) < 2:
        return set()
    best = min(est, key=lambda n: est[n].ms)
    return {n for n, e in est.items() if e.low_ms > est[best].high_ms}


def past_a_slower_count(samples_by_count: Mapping[int, Sequence[float]],
                        counts: Sequence[int]) -> set[int]:
    """Counts on the far side (from the fastest count so far) of a count whose first
    ``EARLY`` samples, even the fastest, ran slower than the fastest count's median (see the
    module docstring); that count itself is still timed."""
    have = {n: samples_by_count[n] for n in counts if len(samples_by_count.get(n, ())) >= EARLY}
    if len(have) < 2:
        return set()
    best = min(have, key=lambda n: typical(have[n]))
    best_ms = typical(have[best])
    ordered = sorted(counts)
    at = ordered.index(best)
    out: set[int] = set()
    for side in (ordered[at + 1:], ordered[:at][::-1]):  # outward from the fastest
        for i, n in enumerate(side):
            if n in have and min(have[n]) > best_ms:
                out.update(side[i + 1:])
                break
    return out


def ruled_out(samples_by_count: Mapping[int, Sequence[float]],
              counts: Sequence[int]) -> set[int]:
    """Counts that need no more samples: lost early, or past a slower count."""
    return losing_counts(samples_by_count, counts) | past_a_slower_count(samples_by_count,
                                                                         counts)


def out_of_reach(refused: Mapping[int, int], samples_by_count: Mapping[int, Sequence[float]],
                 counts: Sequence[int], configured: int, held_out: Sequence[int] = ()) -> set[int]:
    """Counts a range no longer times because the host's cores would not give them (R4.12:
    the core ledger serves a count that does not fit beside the other workers' at a lower
    one): the smallest count ``refused`` more often than it was timed, and every count above
    it (more threads fit less often), the configured count too. Such a count, tried in
    turn, served mostly at counts below it and gave itself few samples: a range waiting for
    its samples explored on, serving every count in turn, 1 thread among them (simulated, 64
    cores, 8 workers, a neighbour on 29: most ranges still exploring after 120 s); beside a
    neighbour on 7 of 16 cores, two workers configured 8 got it seldom, and ranges waiting
    for its samples explored for 30-50 s, auditing every 8th forward at 8 threads on the one
    core left (simulated, 16 cores, seed 12). With the configured count out of reach, the
    rule keeps it (``_rule``): one refusal before its first sample does that, and the count
    served is then the ledger's. Also the
    smallest count ``held_out`` (other tasks' load kept it from being tried for
    ``held_out_s``: ``Learner.explore_served``) and every count above it, the configured one
    too (never the smallest count, by either rule): beside a neighbour on half of 16 cores
    for a whole run, the configured 8 was never tried and its range explored on (97% of
    forwards)."""
    refusing = [n for n in counts if refused.get(n, 0) > len(samples_by_count.get(n, ()))]
    out: set[int] = set()
    if refusing:
        out |= {n for n in counts if n >= min(refusing)}
    held = [n for n in held_out if n > min(counts)]  # held at 1 thread: all are; none out
    if held:
        out |= {n for n in counts if n >= min(held)}
    out.discard(min(counts, default=0))  # the fewest threads stay: no fewer run
    return out


def counts_needing_samples(samples_by_count: Mapping[int, Sequence[float]],
                           counts: Sequence[int], target: int) -> list[int]:
    """Counts with fewer than ``target`` samples that are not ``ruled_out``."""
    out = ruled_out(samples_by_count, counts)
    return [n for n in counts if len(samples_by_count.get(n, ())) < target and n not in out]


def _rule(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
          configured: int, min_samples: int, most: int,
          margin: float) -> tuple[list[int], int | None]:
    """The counts that still need samples, and the count learned once none does (see the
    module docstring). First ``min_samples`` of each count not ``ruled_out``; then, with the
    bar at the configured count's median less ``margin``, every count whose interval
    straddles the bar, and the configured count, take samples up to ``most``; once none
    does, the count with the lowest median under the bar replaces the configured one (none:
    it stays). With the configured count out of the range's reach (not in ``counts``), it
    stays at once, whatever samples the rest have: no other count can be judged against it,
    and where it is served the core ledger and the load serve what fits
    (``core_rules.grant``, ``samples.fastest_under``). Waiting for the rest's
    ``min_samples`` first, a decision they could not change, kept ranges exploring at 1 and
    2 threads for tens of seconds (simulated, 16 cores, 36 seeds: mode 2's latency 0.957
    [0.934, 0.980] of that, better in 30)."""
    if configured not in counts:
        return [], configured
    first = counts_needing_samples(samples_by_count, counts, min_samples)
    if first:
        return first, None
    out = ruled_out(samples_by_count, counts)
    est = {n: estimate(samples_by_count[n]) for n in counts if n not in out}
    base = est.get(configured) or estimate(samples_by_count.get(configured, ()))
    if base is None:  # never timed: past a count already slower than the fastest
        return [], min(est, key=lambda n: (est[n].ms, n))
    bar = base.ms * (1 - margin)
    others = [n for n in est if n != configured]
    unsure = [n for n in others if est[n].low_ms < bar <= est[n].high_ms
              and len(samples_by_count[n]) < most]
    if unsure:
        more = len(samples_by_count.get(configured, ())) < most
        return [configured] * more + sorted(unsure), None
    under = [n for n in others if est[n].ms < bar]
    return [], min(under, key=lambda n: (est[n].ms, n)) if under else configured


def counts_to_sample(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
                     configured: int, min_samples: int, most: int, margin: float) -> list[int]:
    """The counts a range still needs samples of (``_rule``)."""
    return _rule(samples_by_count, counts, configured, min_samples, most, margin)[0]


def choose(samples_by_count: Mapping[int, Sequence[float]], counts: Sequence[int],
           configured: int, min_samples: int, margin: float, most: int) -> int | None:
    """The count a range learns, or None while it needs samples (``_rule``)."""
    return _rule(samples_by_count, counts, configured, min_samples, most, margin)[1]


def speedup(samples_by_count: Mapping[int, Sequence[float]], configured: int,
            count: int) -> float | None:
    """The configured count's median over ``count``'s (None without samples of both, or
    where ``count``'s median is 0)."""
    a, b = samples_by_count.get(configured), samples_by_count.get(count)
    if not a or not b or typical(b) <= 0:
        return None
    return typical(a) / typical(b)


def changed(recent_per_token: Sequence[float], baseline_per_token: float,
            factor: float) -> bool:
    """Forwards at one count now run ``factor`` slower or faster than that same count's
    estimate when the range was learned (R4.11: never a comparison across counts)."""
    if not recent_per_token or baseline_per_token <= 0:
        return False
    ratio = typical(recent_per_token) / baseline_per_token
    return ratio > factor or ratio < 1 / factor
