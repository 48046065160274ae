"""Adaptive threads (R4.3-R4.8, R4.11-R4.13): the coordinator of one worker's learning.

The engine asks ``served_threads`` right before each served forward and tells ``observe``
right after it ends; the shadow loop (``shadow_loop.ShadowLoop``) calls ``step`` (the shadow
side's part: ``shadow_steps.ShadowSteps``); a record watch calls ``poll_record`` (the
record's side: ``record_steps.RecordSteps``). Each call reads plain state and asks the parts
that decide:

- ``ledger.ExactnessLedger``: the only gate on what is served (golden check, voucher,
  transition window, drift). Every shadow is compared bit for bit with the served answer;
  an agreement moves the window on, any difference retires learning for good (R4.7).
- ``learning.Learner``: each range's state (``ranges``: EXPLORING, RELEARNING, LEARNED,
  VERIFYING, SERVING; the report shows the same), its due shadow work (``jobs.JobBoard``)
  and the steps a sample, a comparison or a change take (``estimator``: a count's time per
  range under the load the worker sees, the rule that chooses a count, the change detector).
- ``scheduling.ShadowGate``: when an idle-class shadow may start (never while a served
  forward runs; one sharing the served cores only in gaps that will likely fit).
- ``inflight.InFlight``: the served forwards and the shadow running now (``Timed``: what a
  served forward found at its start, so its time is a sample only if no shadow ran beside).
- ``shadow_side.ShadowSide``: the shadow forwards, the freezer beside timed served forwards,
  the idle-class budget and the paid share (``share``: where no idle CPU comes, a starved
  shadow the window or timing needs runs at normal priority, paid from ``learning_share``
  of served forward time, R4.5 amended), and mode 2's idle verification of shapes no
  voucher covers yet (``idle_verify.IdleVerifier``).
- ``contention.FreeCores``: the cores other tasks leave the worker, an input to the estimate
  (``samples.load_factor``): served samples are scaled by it, and mode 2 serves a learned
  range the count fastest under it (``samples.fastest_under``).
- ``tally.Tally``: what timed and checked what, for the report.

Invariant: mode 1 serves every forward at the configured count; mode 2 serves another count
for a forward only where ``ExactnessLedger.may_serve`` admits it for that forward's shape.
All bookkeeping runs under ``lock``, which is never held across a forward.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.contention import FreeCores
from vllm_srun.tuner.core_rules import grant
from vllm_srun.tuner.golden import Forward, warm_and_check
from vllm_srun.tuner.idle_verify import IdleVerifier
from vllm_srun.tuner.inflight import InFlight, Timed
from vllm_srun.tuner.learning import Learner
from vllm_srun.tuner.ledger import ExactnessLedger, output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.ranges import RangeLearning, wanted_count
from vllm_srun.tuner.record_steps import RecordSteps
from vllm_srun.tuner.samples import fastest_under
from vllm_srun.tuner.scheduling import ShadowGate
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.shadow_loop import ShadowLoop
from vllm_srun.tuner.shadow_side import ShadowSide
from vllm_srun.tuner.shadow_steps import ShadowSteps
from vllm_srun.tuner.tally import Tally

__all__ = ["AdaptiveThreads", "Forward", "RangeLearning", "TunerSettings", "output_bits"]

log = logging.getLogger(__name__)


class AdaptiveThreads(RecordSteps, ShadowSteps):
    """The adaptive ThreadsPolicy of one worker (see the module docstring). ``forward`` runs
    on the served path (golden check, warm-up); ``shadow_forward`` on the idle lanes."""

    several_at_once = True  # each forward is asked and told under ``lock`` (``InFlight``)

    def __init__(self, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                 scope: Scope, record: HostRecord | None, forward: Forward,
                 settings: TunerSettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 shadow_forward: Forward | None = None,
                 on_close: Callable[[], None] | None = None,
                 worker: str | None = None,
                 pause_shadows: Callable[[bool], bool] | None = None,
                 free_cpu_s: Callable[[], tuple[float, float] | None] | None = None,
                 paid_forward: Forward | None = None,
                 free_cpu_resolution_s: Callable[[], float] | None = None,
                 cores: int | None = None) -> None:
        self.mode, self.configured, self.counts = mode, configured, tuple(counts)
        self.clock = clock
        now = self.now  # the parts read the tuner's clock, whatever it is set to later
        self.settings = s = settings or TunerSettings()
        self.forward = forward
        self.lock = threading.Condition()  # bookkeeping only: never held across a forward
        self.sync = RecordSync(record, scope, now)
        self.ledger = ExactnessLedger(mode, configured, s.learning.window)
        self.free_cores = FreeCores(free_cpu_s, s.contention.free_window_s,
                                     free_cpu_resolution_s)
        self.tally = Tally()  # what timed and checked what, for the report
        self.learner = Learner(mode, configured, self.counts, s, self.ledger, self.sync,
                               self.free_cores, self.tally, worker or f"pid {os.getpid()}")
        # what runs now; ``cores``: the budget its served forwards share (several at once)
        self.flight = InFlight(cores=cores or max(self.counts))
        # is the engine behind its arrivals (``Engine.behind``; set by the worker that wires
        # the two): mode 2 then does not explore on served forwards
        self.behind: Callable[[], bool] = lambda: False
        self.gate = ShadowGate(s, configured, max(self.counts), now)
        shadow_forward = shadow_forward or forward
        # a shadow the learning share pays for: the shadow side at normal priority
        self.side = ShadowSide(s, self.lock, now, shadow_forward, paid_forward or shadow_forward,
                               pause_shadows, IdleVerifier(self), on_close,
                               per_range=mode is AdaptiveMode.SERVE)
        self._load()

    def now(self) -> float:
        return self.clock()

    def close(self) -> None:
        self.release_served()
        self.side.freezer.close()
        self.sync.stop_watch()
        self.side.close(self.flush)
        self.sync.gone()

    # -- start-up: warm pass and golden check (R4.3, R4.4) --------------------------------
    def startup(self, golden_rows: list[list[int]],
                reference: np.ndarray | None = None, tolerance: float = 1e-5) -> str | None:
        """Warm, then check the golden answers at the configured count (``golden``); unlock
        exploration (and start the shadow thread) when they hold. Returns why the worker must
        stay out of dispatch, or None. Mode 2 may serve the other counts: they are warmed too."""
        others = [n for n in self.counts if n != self.configured]
        first, why = warm_and_check(self.forward, golden_rows, self.sync, reference, tolerance,
                                    self.configured,
                                    others if self.mode is AdaptiveMode.SERVE else ())
        if why is not None:
            self.ledger.locked_reason = why
            return why
        self.ledger.locked_reason = None
        self.side.budget.restart(self.clock())
        retired = self.ledger.retired is not None
        if self.settings.background and not retired:
            self.side.loop = ShadowLoop(self, first)
            self.side.freezer.start()
            self.sync.watch(self.poll_record, self.settings.watch_s, self.learner.worker)
        log.info("threads_golden_passed mode=%d configured=%d counts=%s retired=%s",
                 self.mode, self.configured, list(self.counts), retired)
        return None

    def runs_exactly(self, rows: int, length: int) -> bool:
        """Does the voucher cover this exact shape beside the configured count (a sweep's
        bounds, or the shape verified itself)? A mode 2 engine then runs it as it comes;
        other forwards pad to the length grid, whose shapes it verifies one by one
        (``Runner.pad_to_grid``). Read on the engine's thread: the voucher is replaced
        whole, never changed in place."""
        v = self.ledger.voucher
        return v.vouches and any(v.covers(rows, length, n, self.configured)
                                 for n in self.counts if n != self.configured)

    # -- ThreadsPolicy ---------------------------------------------------------------------
    def served_threads(self, batch: TokenBatch) -> int:
        """The count for a served forward about to start (it counts as running from now):
        the count its range's state wants (``ranges.wanted_count``), where the exactness
        ledger admits it for this forward's shape (``ExactnessLedger.may_serve``, the only
        gate), else the configured count. A forward of a range still exploring is a timing
        sample: the shadow side is frozen (``pause_shadows``) while it runs, or else its
        time counts only if no shadow ran beside it. Mode 2 with a voucher: such a range
        serves a count it lacks samples for, in turn (vouched exploration, R4.8). It waits
        while a paid shadow that times a count holds its place (``ShadowSteps.step``)."""
        with self.lock:
            self.wait_for_timing_shadow()
            self.gate.served_started(self.clock(), first=self.flight.served_started())
            lo = size_range(batch.padded_tokens)[0]
            learner, r = self.learner, self.learner.ranges.get(lo)
            learning = self.ledger.learning
            wanted = n = wanted_count(r, self.configured) if learning else self.configured
            contention = None
            if learning and r is not None and r.serving and n == r.learned:
                n = self._under_load(r)
                contention = "fallback" if n != r.learned else None
            exploring = learning and r is not None and r.exploring
            if exploring and self.mode is AdaptiveMode.SERVE and self.ledger.voucher.vouches:
                n = learner.explore_served(lo, r, n, self.clock(), self.behind())
            # vouched exploration and a contention fallback need the voucher, not a window
            verdict = self.ledger.may_serve(lo, n, batch.rows, int(batch.input_ids.shape[1]),
                                            explore=n != wanted)
            explored = n != wanted
            if not verdict.allowed:
                n = self.configured
            fitted = self._beside_others(lo, batch, n)
            # a count served lower beside the worker's other forwards is not the one timed
            self.tally.served(verdict, contention, explored and fitted == n)
            self.tally.beside += fitted != n
            self.flight.timed[id(batch)] = self._freeze_for(
                fitted, sampling=r is None or exploring, contention=contention)
            return fitted

    def _beside_others(self, lo: int, batch: TokenBatch, n: int) -> int:
        """Several served forwards at once (``concurrent_forwards``): the rule by which the
        workers of a host share its cores (``core_rules.grant``), applied to the worker's own
        forwards: a count above the configured one serves only where it fits beside the
        threads of the forwards running now (``InFlight.room``), else the largest count below
        it that fits, of the configured one and those the ledger admits for the shape (as a
        contention fallback: the voucher, no window). A forward alone always fits: at one
        client a forward takes the learned count, at many each takes its share. Served so,
        the wanted count is no refusal (``Learner.served``): the worker's own load comes and
        goes; the host's core ledger refuses what other workers hold."""
        room = self.flight.room()
        if n <= max(room, self.configured):
            return n
        cores = self.flight.cores
        return grant(n, self.configured, cores - room, 0, cores, self._vouched_below(lo, batch, n))

    def _vouched_below(self, lo: int, batch: TokenBatch, n: int) -> tuple[int, ...]:
        """The counts below ``n`` the ledger admits for ``batch``'s shape as a contention
        fallback (the voucher, no window): what a count that does not fit may serve at."""
        rows, length = batch.rows, int(batch.input_ids.shape[1])
        return tuple(c for c in self.counts if c < n and
                     self.ledger.may_serve(lo, c, rows, length, explore=True).allowed)

    def _under_load(self, r: RangeLearning) -> int:
        """Mode 2, a range serving its learned count: the count of those the voucher covers
        at or below it that takes the least under the cores other tasks leave now
        (``samples.fastest_under`` over each count's estimate at one size when learned)."""
        free = self.free_cores.at(self.clock())
        if free is None or free >= r.learned:
            return r.learned
        options = {n: ms for (n, kind), ms in r.baselines.items() if kind == "shadow" and (
            n == r.learned or n < r.learned and self.ledger.vouches_for(n))}
        return fastest_under(options, free, r.learned)

    def lower_counts(self, batch: TokenBatch, n: int) -> tuple[int, ...]:
        """Counts below ``n`` that may serve ``batch`` with the answer ``n`` gives, for the
        core ledger to serve where ``n`` does not fit the cores (``core_rules.grant``): in
        mode 2 those the voucher covers for its shape (as a contention fallback: no window),
        else none (the configured count is the ledger's own floor)."""
        if self.mode is not AdaptiveMode.SERVE:
            return ()
        with self.lock:
            if not self.ledger.learning:
                return ()
            return self._vouched_below(size_range(batch.padded_tokens)[0], batch, n)

    def _freeze_for(self, n: int, sampling: bool, contention: str | None) -> Timed:
        """Freeze the shadow side for a served forward at ``n`` about to start, if a shadow
        runs and this forward is timed (``sampling``), or a timing shadow that waited for a
        gap runs on cores this forward needs (their sum over the budget): an idle-class
        shadow sharing its cores made served forwards 1.5x slower here, one beside them not
        at all. Comparisons are not frozen for served forwards that are not timed: under
        back-to-back load they would never end, and mode 2 needs them; nor is a paid shadow
        (the learning share pays for it to run beside served forwards), nor one whose range's
        payable work made no progress for ``starved_s``: under back-to-back load each timed
        forward froze it, so it never ended, and while it held the shadow process no paid
        pass could start either (a 16-connection mode 2 without a voucher: 3,249 freezes and
        no comparison in 120 s); unfrozen, it runs in the idle class and ends, its time no
        sample, its comparison counted. With no shadow running there is nothing to freeze (a
        freeze wakes each of the child's sleeping threads to stop it, and again to thaw it).
        Returns what ``observe`` reads back."""
        flight, freezer = self.flight, self.side.freezer
        sharing = flight.sharing(n, max(self.counts))
        want = freezer.available and bool(flight.shadowing) and not flight.shadow_paid and \
            (sampling or sharing) and not self.learner.board.starved(flight.shadow_lo, self.clock())
        frozen = freezer.served_started(want)
        self.tally.frozen_beside += frozen and sharing
        return Timed(frozen, frozen or not flight.shadowing, flight.shadow_epoch, contention,
                     sampling, n, flight.busy, flight.epoch)

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None:
        """A served forward ended (``None``: it failed)."""
        with self.lock:
            timed = self.flight.served_ended(batch)
            now = self.clock()
            wake = self.gate.served_ended(now, not self.flight.busy, result)
            if result is not None:
                self.side.paid.accrue(result.forward_s, size_range(batch.padded_tokens)[0])
            if timed.froze:
                self.side.freezer.served_ended(lambda: self.gate.thaw_hold_s(
                    self.flight.shadow_gated and bool(self.flight.shadowing), self.clock()))
            learner = self.learner
            if learner.board.jobs and (wake or self.flight.claimed(now)):
                self.lock.notify_all()  # the shadow loop waits for no served forward to run
            if result is None or not self.ledger.learning:
                return
            self.side.verifier.note(batch, result)
            # beside another served forward of this worker its time is no sample, nor one the
            # change detector watches: each slowed the other (several forwards at once)
            solo = self.flight.solo(timed)
            self.tally.not_solo += not solo
            # a sample where shadows were frozen, or none ran beside it
            if learner.served(batch, result, timed.contention or (None if solo else "beside"),
                              timed.sampling and solo and self.flight.alone(timed), now,
                              timed.chosen):
                self.gate.waiting_gap = False
                self.lock.notify_all()

    def shadow_budget_s(self) -> float:
        """Idle-class shadow time allowed so far (``share.ShadowBudget``: what shadows ran
        may not pass it)."""
        with self.lock:
            return self.side.budget.allowed_s(self.clock())
