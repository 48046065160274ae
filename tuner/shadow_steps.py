"""The shadow side of one worker's learning (``adaptive.AdaptiveThreads``, whose part this is):
the shadow loop's ``step`` (the next due shadow, idle-class or paid), what an ended shadow
charges and means, the warm-up of every count on the shadow side. A mixin: it reads the
tuner's ``lock``, ``clock``, ``ledger``, ``learner``, ``flight``, ``gate``, ``side``,
``tally`` and ``counts``, and holds no state of its own.
"""

from __future__ import annotations

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.inflight import ShadowStart
from vllm_srun.tuner.policy import clean_window, preempted
from vllm_srun.tuner.scheduling import ShadowJob


class ShadowSteps:
    def pending_shadows(self) -> int:
        """Size ranges with shadow passes still to run."""
        return len(self.learner.board)

    def step(self) -> bool:
        """Run one due shadow forward on the calling thread (the shadow loop, or a test).
        An idle-class one starts only while no served forward runs and within its budget
        (``ShadowGate.next_shadow``); else a starved one the learning share affords runs paid
        (``_paid_shadow``). False when none may start now."""
        board = self.learner.board
        with self.lock:
            if not self.ledger.learning or not board.jobs:
                return False
            now = self.clock()
            due = None if self.flight.busy or self.side.budget.over(now) else \
                self.gate.next_shadow(now, board.jobs, self.learner.ranges, self.mode)
            self.gate.waiting_gap = due is None
            paid = due is None and (due := self._paid_shadow(now)) is not None
            if due is None:
                return False
            lo, job, count, sharing = due
            epoch = self.flight.epoch
            self.flight.shadow_began(lo, sharing, paid)
            began = self.clock()
            start = ShadowStart(lo, job, count, sharing, paid, epoch, began,
                                self.side.freezer.frozen_total(began))
        try:
            result = self.run_shadow(job.batch, count, paid)
        except RuntimeFault:
            # the shadow side failed (the loop counts it and backs off): not this batch
            # again, the range's next served batch brings its counts
            with self.lock:
                board.failed(lo, job)
            raise
        finally:
            with self.lock:
                self.flight.shadow_paid = False
        with self.lock:
            self._shadow_ended(start, result)
        return True

    def _shadow_ended(self, start: ShadowStart, result: ForwardResult) -> None:
        """A due shadow ended (the lock held): charge what it took, judge whether its time is
        a sample, and let the learner move its range on."""
        lo, job, count, sharing = start.lo, start.job, start.count, start.sharing
        self.side.charge(start, result, self.clock())
        if start.paid:  # timed beside served forwards (its cost to one: ``served_cost_ms``)
            self.learner.after_shadow(lo, job, count, result, clean=True, now=self.clock(),
                                      paid=True)
            return
        clean, before = clean_window(0, start.epoch, self.flight.epoch), self.tally.preempted
        discarded = self.tally.discarded
        if not clean:
            self.tally.discarded += 1
        elif preempted(result.forward_s, result.waited_s):
            self.tally.preempted += 1
            clean = False
        if sharing:
            self.gate.after_sharing(result, clean, self.tally.preempted != before, self.clock())
        # a preempted one is not run again on this batch, unless it shares cores with
        # served forwards: then ``_quiet_s`` and the backoff space its tries out (the load
        # may be over; idle time alone does not: a worker with no traffic is always idle)
        # (an overlapped one is tried again later and later: ``ShadowJob.retry_after``)
        overlapped, now = self.tally.discarded != discarded, self.clock()
        self.learner.after_shadow(lo, job, count, result, clean, now,
                                  retry=sharing or self.tally.preempted == before,
                                  overlapped_at=now if overlapped else None)

    def _paid_shadow(self, now: float) -> tuple[int, ShadowJob, int, bool] | None:
        """The first due shadow, ranges oldest first, that the learning share may pay for
        now: its range made no progress for ``starved_s`` (no idle CPU let one run), it is
        payable (``JobBoard.payable``), the share affords its expected cost, and no timed
        served forward holds the shadow side frozen (it would run nothing)."""
        if self.side.freezer.running:
            return None
        due = self.learner.board.paid_due(now, self.side.paid.affords)
        if due is None:
            return None
        self.side.freezer.release()  # held frozen since the last forward
        return (*due, False)

    def warm_shadows(self, batch: TokenBatch) -> None:
        """Warm every count on the shadow side before any is timed, as a paid shadow: at
        normal priority and never frozen, a few ms once, charged to no budget. As an idle one,
        each timed served forward froze it: a server loaded from its first second (16
        connections) kept its shadow process stopped and learned nothing in 120 s, 6 rounds
        of 6 (``bench/results/adaptive_load_steady.json``)."""
        for n in self.counts:
            with self.lock:
                self.flight.shadow_paid = True
            try:
                self.run_shadow(batch, n, paid=True)
            finally:
                with self.lock:
                    self.flight.shadow_paid = False
        self.side.warm = True

    def run_shadow(self, batch: TokenBatch, count: int, paid: bool = False) -> ForwardResult:
        """One shadow forward (a due one, or a warm-up), counted as running meanwhile;
        ``paid``: on the shadow side at normal priority (``paid_forward``)."""
        with self.lock:
            self.flight.shadow_started(count)
        try:
            return self.side.run(batch, count, paid)
        finally:
            with self.lock:
                self.flight.shadow_ended()
