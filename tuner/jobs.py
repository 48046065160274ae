"""Due shadow work (R4.5, R4.6): per size range, the served batch whose shadows are still to
run (the newest replaces an older one, which would only time the same range again), a backlog
of older batches whose comparison counts toward a transition window still open, and since
when a range's work that the learning share may pay for has waited.

Why the backlog: under bursts of load every batch replaced the last, one window comparison
ran per lull, and ranges that 16 connections reached passed their window only after a minute
or more, serving the configured count meanwhile (0.88x fixed 2 in the first 10 s of 16
connections after learning, the real host). Kept, the first lull passes the whole window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from vllm_srun.tuner.scheduling import ShadowJob


class JobBoard:
    def __init__(self, window: int, toward_window: Callable[[int, ShadowJob], bool]) -> None:
        self.jobs: dict[int, ShadowJob] = {}  # range -> its due batch, oldest range first
        # range -> older batches that count toward its window, newest last (at most
        # ``window`` of them): they run once the range's job is done
        self.backlog: dict[int, deque[ShadowJob]] = {}
        self.starved_since: dict[int, float] = {}  # range -> since when payable work waits
        self.replaced = 0  # shadow batches a newer batch of their range replaced, not run
        self._window, self._toward = window, toward_window

    def __len__(self) -> int:
        return len(self.jobs)

    def put(self, lo: int, job: ShadowJob) -> None:
        """``job`` is range ``lo``'s due batch now (the newest goes to the back)."""
        if (old := self.jobs.pop(lo, None)) is not None:
            self.backlog_job(lo, old, job)
        self.jobs[lo] = job

    def backlog_job(self, lo: int, old: ShadowJob, new: ShadowJob) -> None:
        """A newer batch of range ``lo`` replaced ``old`` before its shadows ran: where both
        would count toward the range's window, ``old`` waits in the backlog (the oldest
        there gives way past ``window``); else it is dropped."""
        if not (self._toward(lo, old) and self._toward(lo, new)):
            self.replaced += 1
            return
        backlog = self.backlog.setdefault(lo, deque(maxlen=self._window))
        self.replaced += len(backlog) == backlog.maxlen
        backlog.append(old)

    def ran(self, lo: int, job: ShadowJob) -> None:
        """A shadow of ``job`` ended (its count taken off, or put back if still due): a job
        with no count left is done, and the range's newest backlogged batch that still
        counts toward its window becomes its job."""
        if not job.counts and self.jobs.get(lo) is job:
            del self.jobs[lo]
        if lo in self.jobs or lo not in self.backlog:
            return
        backlog = self.backlog[lo]
        while backlog:
            nxt = backlog.pop()
            if nxt.counts and self._toward(lo, nxt):
                self.jobs[lo] = nxt
                return
        del self.backlog[lo]

    def failed(self, lo: int, job: ShadowJob) -> None:
        """The shadow side failed on ``job``: not this batch again."""
        if self.jobs.get(lo) is job:
            del self.jobs[lo]

    def forget(self, lo: int) -> None:
        """Range ``lo`` explores again (or serves its learned count): its due work goes."""
        self.jobs.pop(lo, None)
        self.backlog.pop(lo, None)
        self.starved_since.pop(lo, None)

    def clear(self) -> None:
        self.jobs.clear()
        self.backlog.clear()
        self.starved_since.clear()
