"""When an idle-class shadow may start (R4.5 amended: shadows never delay served traffic).

``ShadowGate`` keeps what the served path tells it (each served forward's start and end:
the idle gaps between them, the share of the last ``busy_window_s`` they took:
``BusyWindow``, the count the last one ran at) and what shadows that shared the served
forwards' cores went through (``SharingBackoff``), and picks the next due shadow that may
start now (``next_shadow``).

How it works: idle class is not free where a shadow shares cores with served work (its count
plus the served one over the budget): here a 2-thread idle-class shadow beside 1-thread
served forwards made them 1.5x slower, a 1-thread one not at all. So a shadow that only
times a count on such cores starts only when the worker has been idle long enough that the
next served forward will likely not cut in (recent idle gaps; ``quiet_s`` doubles each time
one was cut in on and halves each ``quiet_halflife_s``). Comparisons (mode 2's window,
audits of what exploring served) run whenever no served forward does; audits of a range
serving its learned count wait for a gap like timing shadows, and under load that leaves no
gap they wait (they are evidence beside the voucher and the window, not what serving waits
for). Where no gap ever comes, the learning share pays for what must complete: timing and the
window (``AdaptiveThreads._paid_shadow``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.estimator import typical
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import likely_uninterrupted
from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.settings import TunerSettings

# the idle gaps kept to judge whether the next served forward will cut in, and how many of
# the latest set the thaw hold: a few seconds of traffic at tens of forwards a second
GAPS_KEPT, GAPS_FOR_HOLD = 32, 8
# the first wait after a core-sharing shadow was cut in on, doubled each time after: 2 ms,
# under the shortest idle gaps seen here between served forwards (a few ms)
QUIET_FIRST_S = 0.002
# the first backoff after ``held_streak`` shadows in a row other tasks held up, doubled with
# each more (up to ``held_backoff_max_s``)
BACKOFF_FIRST_S = 0.1


@dataclass
class ShadowJob:
    batch: TokenBatch
    outputs: np.ndarray
    served_threads: int
    counts: list[int]
    served_s: float  # how long the served forward took
    retries: int = 0  # shadows of it put back after they gave no sample
    not_before: float = 0.0  # ... so its next one waits until then (``retry_after``)

    def retry_after(self, now: float, most_s: float) -> None:
        """A shadow of this batch gave no sample and goes back on the board: the next waits
        ``BACKOFF_FIRST_S``, twice as long with each more, up to ``most_s``."""
        self.retries += 1
        self.not_before = now + min(most_s, BACKOFF_FIRST_S * 2 ** min(self.retries - 1, 16))


Due = tuple[int, ShadowJob, int, bool]  # range, job, count, it shares the served cores


class BusyWindow:
    """The seconds served forwards took in the last ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (end, seconds) of the served forwards that ended in the last ``window_s``
        self._log: deque[tuple[float, float]] = deque()
        self._sum = 0.0  # ... their seconds

    def add(self, end: float, forward_s: float) -> None:
        self._log.append((end, forward_s))
        self._sum += forward_s

    def share(self, now: float) -> float:
        """The share of the last ``window_s`` they took (and it forgets what left it)."""
        since, kept = now - self.window_s, self._log
        while kept and kept[0][0] <= since:
            self._sum -= kept.popleft()[1]
        if not kept:
            self._sum = 0.0  # no rounding carried over
            return 0.0
        end, first = kept[0]  # the oldest may have begun before the window
        return (self._sum - max(0.0, first - (end - since))) / self.window_s


class SharingBackoff:
    """What shadows that shared the served forwards' cores went through: the idle time the
    next one waits for (``quiet``), and a backoff after several that other tasks held up."""

    def __init__(self, settings: TunerSettings, now: float) -> None:
        self.settings = settings.gaps
        # idle time a shadow that shares the served forwards' cores waits for before it
        # starts: doubled each time one was cut into (or waited for CPUs), halved when clean
        self._quiet_s = 0.0
        self._quiet_since = now  # ... set then; it halves each ``quiet_halflife_s``
        self._held_run = 0  # ... those in a row that other tasks' CPUs held up; the next
        self.after_s = 0.0  # starts only from then (``held_streak``)

    def quiet(self, now: float) -> float:
        """The idle time a core-sharing shadow waits for now (``quiet_s``, decayed)."""
        return self._quiet_s * 0.5 ** (max(0.0, now - self._quiet_since) /
                                       self.settings.quiet_halflife_s)

    def after(self, result: ForwardResult, clean: bool, held_up: bool, now: float) -> None:
        """A shadow that shared cores with served forwards ended: the idle time the next
        waits for halves if it was clean, else doubles; after several in a row that other
        tasks held up (``held_streak``; one alone where a CPU-bound task held a CPU for most
        of its length: ``held_hog``), the next waits a backoff."""
        s = self.settings
        quiet_s = self.quiet(now)
        self._quiet_s = quiet_s / 2 if clean else min(s.quiet_max_s,
                                                     max(2 * quiet_s, QUIET_FIRST_S))
        self._quiet_since = now
        if held_up:  # other tasks held its CPUs: back off in time
            hog = (result.waited_s or 0.0) >= s.held_hog * result.forward_s
            self._held_run = max(self._held_run + 1, s.held_streak if hog else 0)
            if (more := self._held_run - s.held_streak) >= 0:
                self.after_s = now + min(s.held_backoff_max_s,
                                         BACKOFF_FIRST_S * 2 ** min(more, 16))
        elif clean:
            self._held_run = 0


class ShadowGate:
    def __init__(self, settings: TunerSettings, configured: int, top: int,
                 clock: Callable[[], float]) -> None:
        self.settings, self.configured, self.top, self.clock = (settings.gaps, configured,
                                                                top, clock)
        self.idle_since = clock()  # when the last served forward ended
        self.gaps: deque[float] = deque(maxlen=GAPS_KEPT)  # idle gaps between served ones
        self.last_served = configured  # the count the last served forward ran at
        self.busy = BusyWindow(self.settings.busy_window_s)
        # the shadow loop waits for a gap that no served forward's end brings, only time
        # (all that is due waits for a gap, the busy share is over ``busy_max``): a served
        # forward that ends wakes it only once that share is under
        self.waiting_gap = False
        # when a core-sharing shadow that waits for idle time (``quiet_s``, the backoff) may
        # start, if no served forward comes first: the shadow loop wakes then, not at its
        # next poll (a shadow that started 30 ms into 35-ms gaps was cut into, and each one
        # cut into doubled the idle time the next waited for, past the gaps)
        self.sharing_at = float("inf")
        self.backoff = SharingBackoff(settings, clock())

    # -- what the served path tells it ----------------------------------------------------
    def served_started(self, now: float, first: bool) -> None:
        """A served forward starts; ``first``: none was running (an idle gap ends)."""
        if first:
            self.gaps.append(now - self.idle_since)

    def served_ended(self, now: float, idle: bool, result: ForwardResult | None) -> bool:
        """A served forward ended (``idle``: none runs now). Returns whether the shadow loop
        should wake: a gap it waits for may have come."""
        if idle:
            self.idle_since = now
        if result is not None:
            self.last_served = result.num_threads
            self.busy.add(now, result.forward_s)
        busy = self.busy_share(now)  # (and it forgets what left the window)
        return not self.waiting_gap or busy <= self.settings.busy_max

    def busy_share(self, now: float) -> float:
        """The share of the last ``busy_window_s`` that served forwards took. Above
        ``busy_max`` requests queue, and any time a shadow takes from them comes back
        amplified in their latency (a 1-thread worker at 60% of capacity: mode 1's p99 went
        1.7x with shadows that fitted the gaps)."""
        return self.busy.share(now)

    def thaw_hold_s(self, gated_shadow_running: bool, now: float) -> float:
        """How long a frozen shadow side stays frozen after the last served forward that
        froze it: twice the recent idle gaps, at most ``thaw_hold_s`` (back-to-back
        forwards: one freeze, not one per forward; with the hold, mode 2 at 16 connections
        went from 0.85x to 1.04x fixed 2 in one A/B, where comparisons were no longer frozen
        too); a shadow that waited for a gap on the served cores, while served forwards take
        over ``busy_max`` of the time, ``busy_window_s`` (thawed in the gaps it would be cut
        into again at once: mode 1's mean 1.04-1.28x fixed 1's at 1 connection; held
        frozen, 1.00-1.01x)."""
        gaps = list(self.gaps)[-GAPS_FOR_HOLD:]
        hold = min(self.settings.thaw_hold_s, 2 * statistics.median(gaps)) if gaps else 0.0
        if gated_shadow_running and self.busy_share(now) > self.settings.busy_max:
            hold = self.settings.busy_window_s
        return hold

    # -- what shadows went through ---------------------------------------------------------
    def quiet(self, now: float) -> float:
        """The idle time a core-sharing shadow waits for now (``quiet_s``, decayed)."""
        return self.backoff.quiet(now)

    def after_sharing(self, result: ForwardResult, clean: bool, held_up: bool,
                      now: float) -> None:
        """A shadow that shared cores with served forwards ended (``SharingBackoff.after``)."""
        self.backoff.after(result, clean, held_up, now)

    def may_share(self, now: float, need_s: float | None) -> bool:
        """A shadow that shares the served forwards' cores and is no due work (mode 2's idle
        verification, ``idle_verify``) may start now: served forwards took at most
        ``busy_max`` of the last window, the worker has been idle ``quiet_s``, no backoff
        runs, and, where its length ``need_s`` is known, the next served forward will likely
        not cut in."""
        idle_s = now - self.idle_since
        return (self.busy_share(now) <= self.settings.busy_max and idle_s >= self.quiet(now)
                and now >= self.backoff.after_s
                and (need_s is None or likely_uninterrupted(self.gaps, idle_s, need_s)))

    # -- the choice --------------------------------------------------------------------------
    def next_shadow(self, now: float, jobs: Mapping[int, ShadowJob],
                    ranges: Mapping[int, RangeLearning], mode: AdaptiveMode) -> Due | None:
        """The first due shadow, ranges oldest first, that may start now, and whether it
        shares cores with served forwards. One that only times a count (on a batch served at
        the configured count; not mode 2's window), or audits a range serving its learned
        count, on cores the next served forward will need too, starts only once the worker
        has been idle ``quiet_s`` and the next forward will likely not cut in
        (``likely_uninterrupted``): it would be frozen and its time thrown away, and the
        frontend's work in the gap, which no freeze covers, runs beside it; and, after one
        that waited for CPUs other tasks held, once its backoff has passed. Under load that
        leaves no such gap, those audits wait: an audit is evidence beside the voucher and
        the window, and one every 2 s, run beside back-to-back served forwards whatever the
        load, cost them about a point of throughput (16 connections, 2 cores, paired: 0.963x
        fixed 2 with it, 0.973x without, one run; the steady bench after, 10 rounds: 0.976x,
        interval 0.972-0.986). The other comparisons (the
        window, audits of what a range served while it explored, a count that fits beside
        the count served) always run, unfrozen beside served forwards that are not timed;
        in a quiet gap, one that needs the gap goes first (mode 1 on 2 cores: a 15-ms
        1-thread shadow took the first half of each 35-ms gap and every 2-thread one that
        followed was cut into)."""
        s, idle_s = self.settings, now - self.idle_since
        calm, quiet_s = self.busy_share(now) <= s.busy_max, self.quiet(now)
        quiet = idle_s >= quiet_s and calm
        self.sharing_at = float("inf")
        anytime: Due | None = None
        for lo, job in jobs.items():
            r = ranges.get(lo)
            if job.not_before > now:
                continue  # put back after a shadow that gave no sample: not yet
            for count in job.counts:
                window = mode is AdaptiveMode.SERVE and r is not None and \
                    r.learned == count and not r.serving
                audit = r is not None and r.serving and job.served_threads != self.configured
                if count + self.last_served <= self.top or window or (
                        job.served_threads != self.configured and not audit):
                    if not quiet:
                        return lo, job, count, False
                    anytime = anytime or (lo, job, count, False)
                    continue  # the gap goes to a shadow that needs one, if any may start
                known = r.samples.get(count) if r is not None else None
                need_s = typical(known) / 1000 if known else \
                    job.served_s * job.served_threads / count
                if quiet and now >= self.backoff.after_s and \
                        likely_uninterrupted(self.gaps, idle_s, need_s):
                    return lo, job, count, True
                if calm:  # the shadow loop wakes when the idle time it waits for is reached
                    self.sharing_at = min(self.sharing_at, max(self.idle_since + quiet_s,
                                                               self.backoff.after_s))
        return anytime
