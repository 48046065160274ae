"""What a timing says of a count (R4.5, R4.11, R4.13): pure functions that turn a served
forward's or a shadow's time into a sample of the estimator (``estimator``), a forward of the
range's smallest size at that count with its cores free; no clock, no lock, no state.

Samples are what a forward at that count takes with its cores free, under the rest of the
load the worker sees (its own front end, its clients):

- served forwards at that count (mode 2 serves vouched counts in turn while a range explores:
  these are the main samples, normal priority, beside whatever the host runs), divided by the
  ``load_factor`` of the cores other tasks left them;
- shadows: an idle-class shadow that ran alone (``policy.clean_window``, not preempted) is
  taken as it is; a paid shadow (``share.PaidShare``: normal priority, beside served
  forwards) or one whose threads waited for CPUs is turned into what that count would cost a
  served forward by ``served_cost_ms``: its wall time less the time its threads spent
  runnable but not running, per thread (``run_delay.forward_wait_s``). Per thread, because
  the threads of one forward mostly wait at the same moments (a busy CPU holds them all up
  at the next barrier). The result is the count's time with its cores free (beside a
  neighbour holding a core, the 2-thread shadows that gave a figure read 0.43-0.73x the
  served time: ``bench/shadow_vs_served.py``), what a served sample is turned into too.

Contention is an input, not a mode (``load_factor``): with ``free`` cores left to the worker
by other tasks, a forward at ``n`` threads takes ``load_factor(n, free)`` times its time with
its cores free. A served forward's time is divided by the factor of its window before it is a
sample (``served_sample_ms``: none at a factor of 2 or more), so every sample of a count
estimates one quantity, whatever the neighbours did then; mode 2 multiplies each count's
estimate by the factor of the window now to pick the count a learned range serves
(``fastest_under``).

At one size (``at_size``): a range spans sizes up to 2x apart, and its forwards' times with
them, as ``tokens ** p`` with ``p`` fitted to the range's own samples (``size_exponent``).
Per token (``p`` = 1) was right for long inputs and wrong for short ones, whose time is
mostly a fixed part: on the simulated bfloat16 16-core host, 16-31 tokens read 1.7x dearer
per token at 16 than at 31 at one count, which hid a count 10% faster
(``bench/moving_best.py``). The report shows the same samples in ms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

# forward time grows at most with the square of the tokens (attention's part); a fitted slope
# past it is noise
MAX_EXPONENT = 2.0


# A shadow whose threads waited, per thread, for more than this share of its wall time ran for
# less than the time it waited: what is left once the wait is taken out is too little of the
# forward to time the count by (under load 5 on 2 vCPUs paid shadows came to 0 ms, and a
# median of 0 ms divided a range's speed-up by zero, which ended the shadow loop). Half: the
# point where the forward's own time stops being the larger part of what was measured.
MAX_WAITED_SHARE = 0.5


def served_cost_ms(forward_s: float, waited_s: float | None, threads: int) -> float | None:
    """What a shadow's forward at ``threads`` would take as a served forward (see the module
    docstring): its time less its threads' run delay, per thread; None (no sample) where the
    wait was over ``MAX_WAITED_SHARE`` of it."""
    per_thread_s = (waited_s or 0.0) / max(1, threads)
    if per_thread_s > MAX_WAITED_SHARE * forward_s:
        return None
    return 1000 * (forward_s - per_thread_s)


def served_sample_ms(forward_ms: float, factor: float) -> float | None:
    """What a served forward that took ``forward_ms`` under a ``load_factor`` of ``factor``
    says of its count with its cores free: its time over the factor; None (no sample) where
    half or more of that time was other tasks' (``MAX_WAITED_SHARE``, as for a shadow): a
    factor of 2 or more, where a thread of the forward shared its core all along and the
    model is least sure (beside a CPU-bound neighbour on 2 cores, samples scaled there left
    2 threads no faster than 1 in 2 of 6 ranges where, taken only with the cores free, it
    was 1.5x faster: ``bench/results/adaptive_load_neighbour_every_sample_scaled.json``)."""
    if 1.0 - 1.0 / factor >= MAX_WAITED_SHARE:
        return None
    return forward_ms / factor


def load_factor(n: int, free: float | None) -> float:
    """How many times its time with its cores free a forward at ``n`` threads takes where
    other tasks left the worker ``free`` cores over the last window (None: unknown, 1).

    The intra-op pools of both backends split a forward into ``n`` equal shares and wait for
    the last, so a forward runs at its slowest thread's pace: a thread whose core another
    task wants runs at half pace while it does (the kernel shares a core evenly between two
    runnable tasks). What other tasks *used* of the ``n`` cores, ``h = n - free``, is what
    they got beside the worker's threads, about half of what they wanted, so a thread
    shares its core for ``2h`` of the time (all of it from half a core used on): the forward
    takes ``1 + min(2h, 1)`` times as long, and never less than the fluid bound ``n / free``
    (every thread gets ``free / n`` of a core). Measured here (2 cores, one CPU-bound
    process, ``tests/test_learning_under_load.py``): 2 threads ran 2x slower and 1 thread
    not at all, while the free cores read 1.24-1.58 with 2 threads serving beside it and
    0.93-1.12 with 1 thread; the rule gives 2x at 2 threads from 1.5 free cores down and 1x
    at 1 thread from 1 up. ``1 + h`` (what they used, not wanted) read 1.4-1.8x there and
    kept 2 threads beside it in ranges 1.8x faster at 2 threads. At or above ``n``: 1."""
    if free is None or free >= n:
        return 1.0
    free = max(free, 0.05 * n)  # nothing left at all: every count at 20x, in proportion
    return max(1.0 + min(2 * (n - free), 1.0), n / free)


def fastest_under(estimates_ms: Mapping[int, float], free: float | None, learned: int) -> int:
    """The count, of ``estimates_ms`` (each count's time with its cores free), that takes the
    least with ``free`` cores left now (``load_factor``); ``learned`` on a tie, or where it
    has no estimate."""
    if learned not in estimates_ms or free is None or free >= learned:
        return learned
    return min(estimates_ms, key=lambda n: (estimates_ms[n] * load_factor(n, free),
                                            n != learned, -n))


def size_exponent(samples_ms: Mapping[int, Sequence[float]],
                  tokens: Mapping[int, Sequence[int]]) -> float:
    """How a range's forward time grows with its padded tokens, ``ms ~ tokens ** p``: the
    slope of log ms on log tokens, pooled over counts within each (least squares on each
    count's samples less their means, so the counts' own speeds leave it), clipped to
    ``[0, MAX_EXPONENT]``; 1 (per token) where no count's sizes differ."""
    return _fit(samples_ms, tokens)[0]


def _fit(samples_ms: Mapping[int, Sequence[float]], tokens: Mapping[int, Sequence[int]]
         ) -> tuple[float, list[int], np.ndarray, np.ndarray]:
    """``size_exponent``, with the counts, the samples' log ms and log tokens it read (one
    array each over every count: a learner calls this on each served forward it explores
    on, so no per-count numpy calls)."""
    counts = [n for n, v in samples_ms.items() if v]
    ms = np.array([m for n in counts for m in samples_ms[n]], np.float64)
    tk = np.array([t for n in counts for t in tokens[n]], np.float64)
    if len(ms) != len(tk):
        raise ValueError("every sample needs its padded tokens")
    sizes = np.array([len(samples_ms[n]) for n in counts])
    starts = np.cumsum(sizes) - sizes
    ly, lx = np.log(np.maximum(ms, 1e-9)), np.log(np.maximum(tk, 1.0))
    x = lx - np.repeat(np.add.reduceat(lx, starts) / sizes, sizes) if counts else lx
    y = ly - np.repeat(np.add.reduceat(ly, starts) / sizes, sizes) if counts else ly
    sxx = float(x @ x)
    if sxx < 1e-9:  # (rounding: sizes one token apart give 6e-5 from one pair)
        return 1.0, counts, ly, lx
    return min(max(float(x @ y) / sxx, 0.0), MAX_EXPONENT), counts, ly, lx


def at_size(samples_ms: Mapping[int, Sequence[float]], tokens: Mapping[int, Sequence[int]],
            size: int, exponent: float | None = None) -> dict[int, list[float]]:
    """Each sample as the time of a forward of ``size`` padded tokens, ``ms * (size /
    tokens) ** p`` (``p``: ``exponent``, else ``size_exponent`` of these samples): what
    the counts of a range are compared by (see the module docstring)."""
    p, counts, ly, lx = _fit(samples_ms, tokens)
    if exponent is not None:
        p = exponent
    sized = np.exp(ly + p * (math.log(size) - lx)).tolist()
    out: dict[int, list[float]] = {n: [] for n in samples_ms}
    at = 0
    for n in counts:
        k = len(samples_ms[n])
        out[n] = sized[at:at + k]
        at += k
    return out
