"""Due shadow work (R4.5, R4.6): per size range, the served batch whose shadows are still to
run (the newest replaces an older one, which would only time the same range again), a backlog
of older batches whose comparison counts toward a transition window still open, and since
when a range's work that the learning share may pay for has waited (``payable``: it times a
count an exploring range needs, or compares toward a window; ``paid_due``: the first such
shadow of a range starved for ``starved_s`` that the share affords).

Why the backlog: under bursts of load every batch replaced the last, one window comparison
ran per lull, and ranges that 16 connections reached passed their window only after a minute
or more, serving the configured count meanwhile (0.88x fixed 2 in the first 10 s of 16
connections after learning, the real host). Kept, the first lull passes the whole window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from vllm_srun.tuner.estimator import typical
from vllm_srun.tuner.ledger import ExactnessLedger
from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.scheduling import ShadowJob
from vllm_srun.tuner.settings import TunerSettings


class JobBoard:
    def __init__(self, settings: TunerSettings, ledger: ExactnessLedger,
                 ranges: Mapping[int, RangeLearning],
                 need: Callable[[RangeLearning], list[int]]) -> None:
        self.jobs: dict[int, ShadowJob] = {}  # range -> its due batch, oldest range first
        # range -> older batches that count toward its window, newest last (at most
        # ``window`` of them): they run once the range's job is done
        self.backlog: dict[int, deque[ShadowJob]] = {}
        self.starved_since: dict[int, float] = {}  # range -> since when payable work waits
        self.replaced = 0  # shadow batches a newer batch of their range replaced, not run
        self._window, self._starved_s = settings.learning.window, settings.spending.starved_s
        # the ranges' state, as the learner keeps it, and the counts one still needs
        self._ledger, self._ranges, self._need = ledger, ranges, need

    # -- what of it counts toward a window, or may be paid for ---------------------------
    def toward_window(self, lo: int, job: ShadowJob) -> bool:
        """``job``'s one comparison would count toward a transition window still open
        (``ExactnessLedger.toward_window``)."""
        r = self._ranges.get(lo)
        return len(job.counts) == 1 and r is not None and self._ledger.toward_window(
            lo, job.served_threads, job.counts[0], r.learned)

    def payable(self, lo: int, job: ShadowJob, count: int) -> bool:
        """A shadow the learning share may pay for: it times a count its exploring range
        lacks samples of, or compares toward a transition window still open (R4.5 amended;
        not audits of what a range serves, nor probes)."""
        r = self._ranges.get(lo)
        return r is not None and ((r.exploring and count in self._need(r)) or
                                  self._ledger.toward_window(lo, job.served_threads, count,
                                                            r.learned))

    def expected_s(self, lo: int, job: ShadowJob, count: int) -> float:
        """How long a shadow of ``job`` at ``count`` will likely take: the count's samples in
        its range, else the served forward's time scaled by the counts' ratio."""
        r = self._ranges.get(lo)
        known = r.samples.get(count) if r is not None else None
        return typical(known) / 1000 if known else job.served_s * job.served_threads / count

    def starved(self, lo: int, now: float) -> bool:
        """Range ``lo``'s payable work made no progress for ``starved_s``."""
        since = self.starved_since.get(lo)
        return since is not None and now - since >= self._starved_s

    def starve_again(self, lo: int, now: float) -> None:
        """Range ``lo``'s due work moved on at ``now`` (a sample, a comparison toward its
        window, or a paid shadow): where the share may still pay for some of what is left,
        it starves again from now, so it is paid again after ``starved_s`` more; else it
        starves no more. A range the traffic reaches rarely is so timed from the batches it
        saw, not only from the next one served (``put``)."""
        job = self.jobs.get(lo)
        if job is not None and any(self.payable(lo, job, n) for n in job.counts):
            self.starved_since[lo] = now
        else:
            self.starved_since.pop(lo, None)

    def paid_due(self, now: float, affords: Callable[[float, int], bool]
                 ) -> tuple[int, ShadowJob, int] | None:
        """The first due shadow, ranges oldest first, whose range starved (``starved``), that
        is payable (``payable``) and whose expected cost the share ``affords`` (given the
        range: in mode 2 its own bucket must hold it too). Where the shared bucket is short
        of the first such shadow, none is paid for until it fills: what accrues is kept for
        that range rather than spent on cheaper shadows of ranges the traffic reaches more
        often, which would take it first for as long as they come (under mode 1 at 60% of
        capacity, range 128-255, the oldest here, had its first 2-thread sample 45 s after
        the others and its twelfth at 131 s, past the 2 minutes a range is to be timed in:
        ``bench.mode1_learning``). A range whose own bucket is short (mode 2) holds back no
        other. A batch backed off after overlapped idle-class shadows
        (``ShadowJob.retry_after``) may still be paid for: a paid shadow runs beside served
        forwards by design, and the share bounds what it costs."""
        for lo, job in self.jobs.items():
            if not self.starved(lo, now):
                continue
            short = False  # the shared bucket is short of one of its payable shadows
            for count in job.counts:
                if not self.payable(lo, job, count):
                    continue
                cost_s = self.expected_s(lo, job, count)
                if affords(cost_s, lo):
                    return lo, job, count
                short |= not affords(cost_s, None)
            if short:
                return None  # kept for this range
        return None

    # -- the board -------------------------------------------------------------------------
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
        if not (self.toward_window(lo, old) and self.toward_window(lo, new)):
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
            if nxt.counts and self.toward_window(lo, nxt):
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
