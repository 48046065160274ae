"""Mode 2 under contention (R4.5): a learned count that now runs slower than a count below it
would, because other tasks hold its cores, gives way to that count meanwhile, and takes its
cores back once they are free. Not yet folded into the estimator (``estimator``'s recent
samples follow a neighbour only once a range relearns); it reads only what the served path
hands it and the last free-cores reading (``FreeCpus.latest``: no file on the served path).

``ContentionWatch`` keeps, per count, how much slower the last few served forwards ran than
when their range was learned (``slowdown``), the free cores other tasks left this worker
over the last whole window of ``contention_free_window_s`` (``free_cpu_s``), and since when
each range serves below its learned count. Where the free cores cannot be read, one forward
every ``contention_probe_s`` at the learned count (a probe) tells when it is over.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable

from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.settings import TunerSettings

log = logging.getLogger(__name__)

FreeCpuReading = Callable[[], "tuple[float, float] | None"]


class ContentionWatch:
    def __init__(self, settings: TunerSettings, counts: tuple[int, ...],
                 clock: Callable[[], float], free_cpu_s: FreeCpuReading | None) -> None:
        self.settings, self.counts, self.clock = settings.contention, counts, clock
        # the last reading of the CPU seconds other tasks left this worker so far, and when
        # it was taken on ``clock`` (``FreeCpus.latest``: read off the served path), or None
        self.free_cpu_s = free_cpu_s
        # range -> since when it serves a count below its learned one under contention
        self._contended_since: dict[int, float] = {}
        # count -> the last few served forwards' time over the range's time at that count
        # when learned (per token): how much slower each count runs on the host now
        self._slowdowns: dict[int, deque[tuple[float, float]]] = {}  # (when, slowdown)
        self._last_probe = -1e9
        self._fast_probes = 0  # contention probes in a row that ran as fast as when learned
        self.freed = 0  # contention ended: other tasks left the cores free
        self.slow_cores_free = 0  # forwards at the learned count ran slow but its cores were
        # free: not contention (the load itself), so it served on
        self._free_mark: tuple[float, float] | None = None  # (when, free s): a window's start
        # cores other tasks left this worker over the last whole window, and its start
        self._free_rate: tuple[float, float] | None = None
        self._free_ok = free_cpu_s is not None  # ... the last reading worked
        self._free_at: dict[int, float] = {}  # count -> when a window last left its cores free
        self._unseen_at = -1e9  # when a read followed a stretch no window covered (a pause)

    def forget(self, lo: int) -> None:
        """Range ``lo`` relearns: it is no longer contended."""
        self._contended_since.pop(lo, None)

    def slowdown(self, n: int) -> float:
        """The median of the last few served forwards at ``n`` over their ranges' times at
        ``n`` when learned (per token), from the last ``contention_fresh_s``; 1.0 (the host
        as it was when learned) when there are none."""
        since = self.clock() - self.settings.fresh_s
        kept = [x for at, x in self._slowdowns.get(n, ()) if at >= since]
        return statistics.median(kept) if kept else 1.0  # a few: np.median costs 15 us

    def under_contention(self, lo: int, r: RangeLearning,
                         vouched: Callable[[int], bool]) -> tuple[int, str | None]:
        """Mode 2, a range serving its learned count L: each count's time when learned
        times how much slower that count runs on the host now (served forwards, any range)
        says what it would take now. When L runs ``contention_slowdown`` slower than it did
        (beyond noise) and a vouched count below it would now be faster by
        ``contention_margin`` (a neighbour took a core: here 2 threads ran 2x slower beside
        one CPU-bound process, 1 thread not at all), the fastest such count serves
        meanwhile (where the free cores are read: once other tasks hold L's cores, the
        count that fits the cores they left, ``_fits``), and one forward every
        ``contention_probe_s`` at L tells when that is over
        (a neighbour that comes and goes in seconds is followed within a second). Still so
        after ``contention_relearn_s``: the range relearns under what the host is now. Where
        the free cores can be read, no probes: it is over once other tasks leave the learned
        count's cores (``_freed``: one ``contention_free_window_s`` after a neighbour left,
        where a probe ran L beside it, here 2.5x slower, every 0.25 s and two fast ones in a
        row ended it). Returns the count and why (None, "fallback" or "probe")."""
        s, big, now = self.settings, r.learned, self.clock()
        # read on: a whole window is there when it slows
        rate = self._free_cores(now) if self.free_cpu_s is not None else None
        # once contended with free cores to read, only they end it: L runs no forward
        # meanwhile, and its slow times would only age out
        since = self._contended_since.get(lo)
        held = since is not None and self._free_ok
        slowed, at_big = self.slowdown(big), r.baselines.get((big, "shadow"))
        below = [(base * self.slowdown(n), n) for n in self.counts if n < big
                 and (base := r.baselines.get((n, "shadow"))) is not None
                 and vouched(n)]
        if at_big is None or not below or not held and (
                slowed < s.slowdown or (
                    rate is None
                    and at_big * slowed <= min(below)[0] * (1 + s.margin))):
            self._contended_since.pop(lo, None)
            return big, None
        small = self._fits(below, rate) if rate is not None else min(below)[1]
        if since is None and self.free_cpu_s is not None and \
                self._cores_free(now, big):
            self.slow_cores_free += 1  # slow, but no other task holds its cores: the load
            return big, None
        if since is None:
            self._contended_since[lo] = now
            log.info("threads_contended range=%d-%d serving=%d slowdown=%.2f", lo,
                     2 * lo - 1, small, slowed)
        elif now - max(since, self._held_since(big)) > s.relearn_s:
            # contended all along: since it began, no window left the cores free (a range
            # served every few seconds saw a neighbour 2 s of every 4 and relearned 6-9 times
            # in 9 minutes on the simulator, measuring from its own first contended forward),
            # and windows covered all of it (a pause in traffic is no sign: on the real host
            # the first forward after 10 s without traffic relearned, ``contended_s=13``)
            log.info("threads_relearn range=%d-%d contended_s=%.0f", lo, 2 * lo - 1,
                     now - since)
            self._contended_since.pop(lo, None)
            return big, "relearn"
        freed = self._freed(now, big, since)
        if freed:  # the slow times at ``big`` were the neighbour's: forget them
            self._slowdowns.pop(big, None)
            self._contended_since.pop(lo, None)
            self.freed += 1
            log.info("threads_contention_over range=%d-%d serving=%d", lo, 2 * lo - 1, big)
            return big, None
        if freed is None and now - self._last_probe >= s.probe_s:
            self._last_probe = now
            return big, "probe"
        return small, "fallback"

    def _fits(self, below: list[tuple[float, int]], rate: tuple[float, float]) -> int:
        """The count a contended range serves where the free cores are read: the largest
        vouched count below the learned one that the cores other tasks left fit (to within
        ``contention_free_slack``), else the smallest. Not the count the slowdowns predict
        fastest: each count's slowdown is the median over recent forwards of any range, at
        times seconds old, and at the start of each of a toggling neighbour's phases the
        1-thread slowdown still held the last phase's (1.4-1.55x; 1 thread then ran 1.2x
        faster than 2, per token): beside the neighbour at 16 connections, mode 2 began
        serving 1 thread 0.27-0.52 s into a 2-s phase, and in one of six not at all."""
        fit = [n for _, n in below if n <= rate[0] + self.settings.free_slack]
        return max(fit) if fit else min(n for _, n in below)

    def _cores_free(self, now: float, n: int) -> bool:
        """Other tasks held less than ``contention_held_min`` of the cores ``n`` threads
        need over the last whole window: contention does not start. Served at 2 threads
        on this 2-core host, 16 and 1 connections, wrk on the same cores: 1.89-2.0 cores
        free (10th-90th percentile of 0.1-s windows) with no neighbour, 1.0-1.5 beside one
        CPU-bound process (the server process counts as the worker's own). With this bar
        (a quarter of a core), contention began 4-17 forwards after such a neighbour came,
        one client; with half a core, 6-46; with no bar, 5-22. Slow forwards alone started
        it with none there (the load itself: mode 2 served 97 forwards below its learned
        count at 16 connections, 0.94x fixed 2). False where the free cores cannot be read,
        or no recent whole window says (forwards over a second apart): the slowdowns decide
        alone."""
        rate = self._free_cores(now)
        if not self._free_ok:
            return False
        return rate is not None and rate[0] > n - self.settings.held_min

    def _freed(self, now: float, learned: int, since: float | None) -> bool | None:
        """Contention is over: over a whole window begun after the fallback began, other
        tasks held at most ``contention_held_end`` of the learned count's cores (under
        ``contention_held_min``, which starts it). None where the free cores cannot be read
        (probes tell)."""
        rate = self._free_cores(now)
        if rate is None:
            return None if not self._free_ok else False
        cores, began = rate
        return since is not None and began >= since and \
            cores >= learned - self.settings.held_end

    def _free_cores(self, now: float) -> tuple[float, float] | None:
        """The cores other tasks left this worker over the last whole window of at least
        ``contention_free_window_s`` between two readings of ``free_cpu_s`` (each taken
        off the served path: reading one here opens no file), and when that window began;
        None where they cannot be read, or before a whole window."""
        if self.free_cpu_s is None:
            self._free_ok = False
            return None
        mark, window = self._free_mark, self.settings.free_window_s
        reading = self.free_cpu_s()
        self._free_ok = reading is not None
        # a reading over 10 windows old says nothing of now (the reader rests while no
        # forward asks), nor does one over 10 windows after ``mark`` (no forward read in
        # between): what the cores did meanwhile is unknown
        old = reading is not None and now - reading[0] > 10 * window
        if reading is not None and not old and mark is not None and \
                reading[0] - mark[0] < window:
            return self._free_rate  # no whole window since the last
        self._free_mark = None if reading is None or old else reading
        stale = old or mark is None or reading is None or reading[0] - mark[0] > 10 * window
        if stale:
            self._unseen_at = now
        self._free_rate = None if reading is None or stale else \
            ((reading[1] - mark[1]) / (reading[0] - mark[0]), mark[0])
        if self._free_rate is not None:  # which counts' cores this window left free (as
            # ends contention: a window between the thresholds is no break in it, else a
            # range contended there would neither end it nor relearn, for good)
            end = self.settings.held_end
            self._free_at.update({n: now for n in self.counts
                                  if self._free_rate[0] >= n - end})
        return self._free_rate

    def cores_busy(self, now: float, n: int) -> bool:
        """A served forward at ``n`` of a range exploring is no sample: other tasks held the
        cores it needs (``n`` beyond the free cores by more than ``contention_free_slack``).
        Not once windows have seen them held for
        ``contention_relearn_s`` without a break (as contention relearns): such a neighbour
        is the host now, and the range learns under it. Beside one that took a core 2 s of
        every 4, a range learned from 12 samples per count inside one of its phases (mode 2
        then served 1 thread where 2 were 1.2-1.4x faster); counted from the range's first
        sample instead, one that explored for over 10 s kept samples of both phases (the
        real host, 64-127 padded tokens: 8 of 15 at 2 threads the neighbour's, and it
        learned 1 thread)."""
        rate = self._free_cores(now)
        if rate is None or rate[0] >= n - self.settings.free_slack:
            return False
        return now - self._held_since(n) < self.settings.relearn_s

    def _held_since(self, n: int) -> float:
        """Since when windows have seen other tasks hold ``n`` threads' cores without a
        break: the last window that left them free, or the last read after a stretch no
        window covered (a pause in traffic says nothing either way)."""
        return max(self._free_at.get(n, -1e9), self._unseen_at)

    def note_slowdown(self, n: int, slowdown: float, probe: bool) -> None:
        """A served forward at ``n`` ran ``slowdown`` times its range's time when learned.
        Two contention probes in a row as fast as when learned end contention at once (one
        may meet a neighbour the kernel descheduled for a moment)."""
        kept = self._slowdowns.setdefault(n, deque(maxlen=5))
        if probe:
            fast = slowdown < self.settings.slowdown
            self._fast_probes = self._fast_probes + 1 if fast else 0
            if self._fast_probes >= 2:
                kept.clear()
        kept.append((self.clock(), slowdown))

