"""The shadow side of one worker's learning (``adaptive.AdaptiveThreads``, whose part this is):
the shadow loop's ``step`` (the next due shadow, idle-class or paid), what an ended shadow
charges and means, the warm-up of every count on the shadow side, and the wait of a served
forward whose place a paid shadow that times a count holds. A mixin: it reads the tuner's
``lock``, ``clock``, ``ledger``, ``learner``, ``flight``, ``gate``, ``side``, ``tally``,
``counts`` and ``settings``, and holds no state of its own.
"""

from __future__ import annotations

import time

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.inflight import ShadowStart
from vllm_srun.tuner.policy import clean_window, preempted
from vllm_srun.tuner.scheduling import ShadowJob

# A paid shadow that times a count claims the served forwards' place for at most this long
# while the forwards running end (one forward of the longest inputs runs about a second at
# 1 thread, FACTS.md); the claim is renewed at each try, so it lapses only where the shadow
# loop stopped trying
CLAIM_S = 1.0

# The longest a paid shadow that times a count holds the served forwards' place (``step``):
# twice what the paid bucket holds (``share.PAID_CAP_S``), so a shadow that runs over its
# expected cost still ends first, while one whose shadow process hung holds serving no longer
HOLD_MAX_S = 2.0


class ShadowSteps:
    def pending_shadows(self) -> int:
        """Size ranges with shadow passes still to run."""
        return len(self.learner.board)

    def step(self) -> bool:
        """Run one due shadow forward on the calling thread (the shadow loop, or a test).
        An idle-class one starts only while no served forward runs and within its budget
        (``ShadowGate.next_shadow``); else a starved one the learning share affords runs paid
        (``_paid_shadow``). False when none may start now.

        A paid shadow whose time is to be a sample (``_times_a_count``) runs in the served
        forwards' place: it starts only while none runs, and served forwards about to start
        wait until it ends (``held_until``; while it waits for those running, its claim makes the
        next ones wait: ``claim_until``). Beside a served forward it timed the CPUs that
        forward left it: on 2 vCPUs at 60% of capacity, 2-thread shadows beside 1-thread
        served forwards ran 1.4-2.0x the served 1-thread median, and mode 1 kept 1 thread
        in every range where 2 threads were faster (``bench.mode1_learning``). Only where
        a shadow loop thread runs (``TunerSettings.background``), or where the caller holds
        served forwards back itself (``hold_place``: the simulator); a test that steps by
        hand runs it beside served forwards."""
        board = self.learner.board
        with self.lock:
            claimed, self.flight.claim_until = self.flight.claim_until, 0.0
            due, paid, held = self._next_due()
            if held and self.flight.busy:
                # the served forwards' place, once those running end (``observe`` wakes us)
                self.flight.claim_until = self.clock() + CLAIM_S
                return False
            if claimed and not held:
                self.lock.notify_all()  # served forwards that waited for its claim go on
            if due is None:
                return False
            lo, job, count, sharing = due
            self.flight.held_until = self.clock() + HOLD_MAX_S if held else 0.0
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
                if self.flight.held_until:
                    self.flight.held_until = 0.0
                    self.lock.notify_all()  # served forwards wait for it to end
        with self.lock:
            self._shadow_ended(start, result)
        return True

    def wait_for_timing_shadow(self) -> None:
        """A served forward is about to start (the lock held, released while waiting): wait
        while a paid shadow that times a count runs in its place or claims it (``step``), for
        ``HOLD_MAX_S`` at most after that shadow started."""
        flight, began, waited = self.flight, time.monotonic(), False  # (waited: real time)
        while (left := max(flight.held_until, flight.claim_until) - self.clock()) > 0:
            waited = True
            self.lock.wait(left)
        if waited:
            self.tally.waited += 1
            self.tally.waited_s += time.monotonic() - began

    def place_held_until(self) -> float:
        """Until when (the tuner's clock) a served forward about to start would wait for a
        paid shadow that times a count (``wait_for_timing_shadow``); in the past where none
        would. A caller that holds served forwards back itself (``TunerSettings.hold_place``)
        starts none before then; the shadow's end or the claim's release comes sooner."""
        with self.lock:
            return max(self.flight.held_until, self.flight.claim_until)

    def release_served(self) -> None:
        """The tuner closes: no served forward waits for a shadow any more."""
        with self.lock:
            self.flight.held_until = self.flight.claim_until = 0.0
            self.lock.notify_all()

    def _next_due(self) -> tuple[tuple[int, ShadowJob, int, bool] | None, bool, bool]:
        """The shadow to start now (the lock held), whether the share pays for it, and
        whether it is to hold the served forwards' place (see ``step``)."""
        board = self.learner.board
        if not self.ledger.learning or not board.jobs:
            return None, False, False
        now = self.clock()
        due = None if self.flight.busy or self.side.budget.over(now) else \
            self.gate.next_shadow(now, board.jobs, self.learner.ranges, self.mode)
        self.gate.waiting_gap = due is None
        paid = due is None and (due := self._paid_shadow(now)) is not None
        held = paid and (self.settings.background or self.settings.hold_place) and \
            self._times_a_count(*due[:3])
        return due, paid, held

    def _times_a_count(self, lo: int, job: ShadowJob, count: int) -> bool:
        """Is a shadow of ``job`` at ``count`` to be a sample: a count its exploring range
        lacks samples of, which the range's own served forwards do not time?"""
        r = self.learner.ranges.get(lo)
        return r is not None and r.exploring and count in self.learner.need(r) and \
            not self.learner.times_served(r, count, job.batch)

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
