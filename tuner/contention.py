"""Contention as an input to the estimate (R4.13), not a mode of its own.

``FreeCores`` turns the readings of ``free_cpu_s`` (``FreeCpus.latest``: the cumulative
seconds this worker's cores were left to it, read by a thread of its own, so no file is opened
on the served path) into the cores other tasks left it over the last whole window of
``contention_free_window_s``. ``samples.load_factor`` says what that does to a forward at a
count; the tuner uses it twice, one way and back:

- a served forward's time is divided by it before it becomes a sample (``Learner.served``,
  and the change detector's served times): the count's time with its cores free, which is
  what a shadow's figure is too (``samples.served_cost_ms``, its threads' waits taken out),
  so samples from both sides and from any moment of a neighbour's come to one quantity;
- mode 2 serves a learned range the count whose estimate, multiplied by it, is the lowest now
  (``samples.fastest_under``, over the counts the voucher covers below the learned one).

The reading is rounded: ``/proc`` counts CPU time in ticks of 10 ms, and a window of 0.1 s
sums eight such counters on 2 CPUs (each CPU's idle and iowait time, the worker's and its
shadow process's user and system time), so a 2-thread worker under 16 connections, with
nothing else running that used more than 0.01 core, read 1.89 free cores or fewer in a tenth
of its windows (``FreeCpus.resolution_s``); at 2 threads that is a load factor of 1.2, and
ranges under 1.2x faster at 2 threads were served at 1. What other tasks use
under twice the rounding's standard deviation over the window (0.23 core there) reads as
nothing: it is added back to the free time. A neighbour holding a core still reads as one
(0.77 of it or more: 2x at 2 threads, as before).

There is no state beyond the window: a neighbour that comes is followed at the next window
and one that leaves too; nothing starts or ends, probes or relearns. Where the free cores
cannot be read (no ``/proc``), the factor is 1: served times are taken as they are, and a
neighbour that stays shows as a change (``estimator.changed``), which relearns the range.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_srun.tuner.free_cpus import UNRESOLVED_SDS

FreeCpuReading = Callable[[], "tuple[float, float] | None"]

# a reading over this many windows old says nothing of now (the reader rests while no forward
# asks), nor does a window this many times longer than asked (no forward read in between):
# what the cores did meanwhile is unknown
STALE_WINDOWS = 10


class FreeCores:
    def __init__(self, reading: FreeCpuReading | None, window_s: float,
                 resolution_s: Callable[[], float] | None = None) -> None:
        """``resolution_s``: the standard deviation, in seconds, of the difference between
        two readings that rounding alone puts there (``FreeCpus.resolution_s``; none where
        the reading is exact, as the simulator's is): what other tasks use under twice it
        over a window reads as nothing (``at``)."""
        self.reading, self.window_s = reading, window_s
        self.resolution_s = resolution_s
        self._mark: tuple[float, float] | None = None  # (when, free s): a window's start
        # the cores other tasks left this worker over the last whole window, and its start
        self.window: tuple[float, float] | None = None

    def at(self, now: float) -> float | None:
        """The cores other tasks left this worker over the last whole window of at least
        ``window_s`` between two readings; None where they cannot be read, or before a whole
        window (then nothing scales: ``samples.load_factor``)."""
        got = self.reading() if self.reading is not None else None
        if got is None or now - got[0] > STALE_WINDOWS * self.window_s:
            self._mark = self.window = None
            return None
        mark = self._mark
        if mark is not None and got[0] - mark[0] < self.window_s:
            return self.window[0] if self.window is not None else None  # no whole window yet
        self._mark = got
        stale = mark is None or got[0] - mark[0] > STALE_WINDOWS * self.window_s
        if stale:
            self.window = None
            return None
        span = got[0] - mark[0]
        noise = UNRESOLVED_SDS * self.resolution_s() if self.resolution_s is not None else 0.0
        self.window = ((got[1] - mark[1] + noise) / span, mark[0])
        return self.window[0]
