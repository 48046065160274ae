"""Adaptive threads (R4.3-R4.8, R4.11-R4.13): the coordinator of one worker's learning.

The engine asks ``served_threads`` right before each served forward and tells ``observe``
right after it ends; the shadow loop (``shadows.ShadowLoop``) calls ``step``; a record watch
calls ``poll_record``. Each call reads plain state and asks the parts that decide:

- ``ledger.ExactnessLedger``: the only gate on what is served (golden check, voucher,
  transition window, drift). Every shadow is compared bit for bit with the served answer;
  an agreement moves the window on, any difference retires learning for good (R4.7).
- ``ranges``: each range's phase (EXPLORING, RELEARNING, LEARNED, VERIFYING, SERVING), moved
  only by ``learn``, ``settle`` and ``relearn``; the report shows the same state.
- ``estimator``: a count's time per range under the load the worker sees (the median of
  recent samples with its interval), the rule that chooses a count, the change detector.
- ``scheduling.ShadowGate`` and ``freezer.Freezer``: when an idle-class shadow may start
  (never while a served forward runs; one sharing the served cores only in gaps that will
  likely fit) and freezing the shadow side beside timed served forwards.
- ``share``: the idle-class budget, and the paid share: where no idle CPU comes, a starved
  shadow the window or timing needs runs at normal priority, paid from ``learning_share``
  of served forward time (R4.5 amended).
- ``jobs.JobBoard``: the due batch per range and the backlog of window comparisons.
- ``contention.ContentionWatch``: mode 2 serving a count below the learned one while other
  tasks hold its cores (not yet folded into the estimator).
- ``idle_verify.IdleVerifier``: mode 2 verifies, in idle time, shapes no voucher covers yet
  (written with the flush as verified shapes; the ledger reads them through the voucher).

Samples: a range exploring times each count on its served forwards (the shadow side frozen
meanwhile, or none beside it) and on shadows; mode 2 with a voucher serves the counts it
lacks samples for in turn (vouched exploration), audited at the configured count. Once
learned, every ``audit_every``-th forward gets a probe shadow at another count, and forwards
at a count that moved by ``relearn_factor`` from that same count when learned relearn the
range (R4.11). A new worker learns from fresh samples; drift and vouchers survive restarts.

Invariant: mode 1 serves every forward at the configured count; mode 2 serves another count
for a forward only where ``ExactnessLedger.may_serve`` admits it for that forward's shape.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_srun.records.host_record import DriftEvent, HostRecord, Scope
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.contention import ContentionWatch
from vllm_srun.tuner.estimator import (
    changed,
    choose,
    counts_needing_samples,
    served_cost_ms,
    typical,
)
from vllm_srun.tuner.freezer import Freezer
from vllm_srun.tuner.idle_verify import IdleVerifier
from vllm_srun.tuner.jobs import JobBoard
from vllm_srun.tuner.ledger import ExactnessLedger, Refusal, first_difference, output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.policy import clean_window, preempted, shadow_plan
from vllm_srun.tuner.ranges import Phase, RangeLearning, learn, relearn, settle, wanted_count
from vllm_srun.tuner.scheduling import ShadowGate, ShadowJob
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.shadows import STOP_WAIT_S, ShadowLoop
from vllm_srun.tuner.share import PaidShare, ShadowBudget

__all__ = ["AdaptiveThreads", "RangeLearning", "TunerSettings", "output_bits"]

log = logging.getLogger(__name__)

Forward = Callable[[TokenBatch, int], ForwardResult]


@dataclass
class Tally:
    """What timed and checked what (the report's ``learning`` section)."""

    discarded: int = 0  # shadows whose time overlapped a served forward
    preempted: int = 0  # shadows whose threads waited for CPUs other tasks held
    uncovered: int = 0  # forwards kept at the configured count: the voucher lacks the shape
    frozen_beside: int = 0  # served forwards that froze a shadow sharing their cores
    served_samples: int = 0  # samples taken from served forwards
    explored: int = 0  # mode 2: forwards served at a vouched count to time it
    contended: int = 0  # mode 2: forwards served below the learned count under contention
    contention_probes: int = 0  # ... and at the learned count meanwhile, to see it end
    samples_cores_busy: int = 0  # served samples not kept: other tasks held their cores


class AdaptiveThreads:
    """The adaptive ThreadsPolicy of one worker (see the module docstring). ``forward`` runs
    on the served path (golden check, warm-up); ``shadow_forward`` on the idle lanes."""

    def __init__(self, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                 scope: Scope, record: HostRecord | None, forward: Forward,
                 settings: TunerSettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 shadow_forward: Forward | None = None,
                 on_close: Callable[[], None] | None = None,
                 worker: str | None = None,
                 pause_shadows: Callable[[bool], bool] | None = None,
                 free_cpu_s: Callable[[], tuple[float, float] | None] | None = None,
                 paid_forward: Forward | None = None) -> None:
        self.mode, self.configured, self.counts = mode, configured, tuple(counts)
        self.clock = clock
        now = self.now  # the parts read the tuner's clock, whatever it is set to later
        self.sync = RecordSync(record, scope, now)
        self.forward = forward
        self.shadow_forward = shadow_forward or forward
        # a shadow the learning share pays for: the shadow side at normal priority
        self.paid_forward = paid_forward or self.shadow_forward
        self.settings = settings or TunerSettings()
        self.on_close = on_close
        self.worker = worker or f"pid {os.getpid()}"  # named in the drift it records
        self.ledger = ExactnessLedger(mode, configured, self.settings.window)
        self.shadow_error: str | None = None
        self.shadow_faults = 0  # shadow forwards that failed (a ShadowProcess restarts)
        self.ranges: dict[int, RangeLearning] = {}
        self.lock = threading.Condition()  # bookkeeping only: never held across a forward
        self.tally = Tally()  # what timed and checked what, for the report
        self.freezer = Freezer(pause_shadows, self.lock, now)
        self.board = JobBoard(self.settings.window, self._toward_window)
        self.paid = PaidShare(self.settings.learning_share)
        self._shadow_paid = False  # the shadow running now is a paid one: never frozen
        self._shadow_lo = 0  # ... and its range (``_shadow_starved``)
        self._busy = 0  # served forwards running now
        self._epoch = 0  # served forwards started plus ended
        self._shadowing = 0  # shadow forwards running now
        self._shadow_epoch = 0  # shadow forwards started plus ended
        # served forwards running: id(batch) -> (it froze the shadow side, no shadow could
        # run at its start, shadow epoch then, contention's reason, it may be a sample)
        self._timed: dict[int, tuple[bool, bool, int, str | None, bool]] = {}
        self._shadow_threads = 0  # the count of the shadow running now
        self._shadow_gated = False  # ... it waited for a gap (``_next_shadow``)
        self.shadows_warm = False  # the shadow loop has run every count once
        self.gate = ShadowGate(self.settings, configured, max(self.counts), now)
        self.contention = ContentionWatch(self.settings, self.counts, now, free_cpu_s)
        # idle-class shadow time charged to ``budget_fraction``: a shadow's wall time less
        # what it spent frozen (``Freezer.frozen_total``: SIGSTOP) or waiting for CPUs
        # (its threads' run delay, per thread): a shadow frozen through a burst of load took
        # no CPU, and charged its wall time, one held frozen through 16-connection bursts
        # spent the budget for minutes (mode 2: 0-1 window passes per range in 2 minutes,
        # 0.68x fixed 2 at 16 connections)
        self.budget = ShadowBudget(self.settings.budget_fraction, self.settings.budget_window_s,
                                   clock())
        self.shadow_wall_s = 0.0  # ... and what they took in wall time
        self.idle_verifier = IdleVerifier(self)  # mode 2: shapes verified in idle time
        self._loop: ShadowLoop | None = None
        self._load()

    # -- the ledger's state, as the report, the simulator and tests read it ---------------
    locked_reason = property(lambda self: self.ledger.locked_reason,
                             lambda self, v: setattr(self.ledger, "locked_reason", v))
    voucher = property(lambda self: self.ledger.voucher,
                       lambda self, v: setattr(self.ledger, "voucher", v))
    retired = property(lambda self: self.ledger.retired)
    retired_at = property(lambda self: self.ledger.retired_at)
    comparisons = property(lambda self: self.ledger.comparisons)
    audits = property(lambda self: self.ledger.audits)
    _shadow_s = property(lambda self: self.budget.used_s)  # idle-class shadow time charged
    _sharing_at = property(lambda self: self.gate.sharing_at)  # the shadow loop wakes then
    replaced = property(lambda self: self.board.replaced)
    discarded = property(lambda self: self.tally.discarded)
    preempted = property(lambda self: self.tally.preempted)
    uncovered = property(lambda self: self.tally.uncovered)
    frozen_beside = property(lambda self: self.tally.frozen_beside)
    served_samples = property(lambda self: self.tally.served_samples)
    explored = property(lambda self: self.tally.explored)
    contended = property(lambda self: self.tally.contended)
    contention_probes = property(lambda self: self.tally.contention_probes)
    samples_cores_busy = property(lambda self: self.tally.samples_cores_busy)
    # contention's, as the report and the simulator read them
    contention_freed = property(lambda self: self.contention.freed)
    slow_cores_free = property(lambda self: self.contention.slow_cores_free)
    free_cpu_s = property(lambda self: self.contention.free_cpu_s,
                          lambda self, v: setattr(self.contention, "free_cpu_s", v))

    def now(self) -> float:
        return self.clock()

    # -- the record ----------------------------------------------------------------------
    scope = property(lambda self: self.sync.scope)
    record = property(lambda self: self.sync.record)
    record_error = property(lambda self: self.sync.error,
                            lambda self, v: setattr(self.sync, "error", v))

    def _load(self) -> None:
        """Drift retirement and the voucher survive a restart; stored samples and learned
        counts are history: a new worker learns from fresh samples (R4.11)."""
        event = self.sync.guard("read_drift", lambda rec: rec.drift(self.scope))
        if event is not None:
            self.ledger.retire(event)
        self.voucher = self.sync.guard("read_voucher", lambda rec: rec.voucher(self.scope)) \
            or self.voucher

    def flush_due(self) -> bool:
        """Learnings wait to be written and ``flush_s`` has passed since the last flush."""
        with self.lock:
            return bool(self.sync.pending) and \
                self.clock() - self.sync.last_flush >= self.settings.flush_s

    def flush(self) -> None:
        """Write pending samples, learned counts and traffic comparisons to the record."""
        with self.lock:
            taken = self.sync.take(self.clock())
            learned = {lo: (r.learned, self._speedup(r), self.ledger.progress(lo, r.learned))
                       for lo in taken.learned if (r := self.ranges[lo]).learned}
        self.sync.write(taken, learned, self.configured)

    def poll_record(self) -> None:
        """Read drift and the voucher back from the record (the watch thread): a drift any
        worker of the scope recorded retires this one; a new sweep or a reset shows here."""
        if self.record is None or self.retired is not None:
            return
        event = self.sync.guard("read_drift", lambda rec: rec.drift(self.scope))
        voucher = self.sync.guard("read_voucher", lambda rec: rec.voucher(self.scope))
        with self.lock:
            if voucher is not None:
                self.voucher = voucher
            if event is not None and self.retired is None:
                self._retire(event)
                log.warning("threads_drift_seen_by_another worker=%s seen_by=%s rows=%d "
                            "padded_tokens=%d", self.worker, event.worker, event.rows,
                            event.padded_tokens)
            else:  # a new sweep, or a reset: ranges start or stop serving at once
                self.voucher_changed()

    def voucher_changed(self) -> None:
        """The voucher changed (the tuner's lock held): each range starts or stops serving
        its learned count as the ledger now admits it."""
        for lo, r in self.ranges.items():
            self._settle(lo, r)

    def close(self) -> None:
        self.freezer.close()
        self.sync.stop_watch()
        loop, self._loop = self._loop, None
        if loop is not None and not loop.stop(STOP_WAIT_S):
            # a shadow in flight did not end (a hung child): closing the shadow side ends it
            log.warning("shadow_loop_stuck wait_s=%.0f action=close_shadow_side", STOP_WAIT_S)
        self.flush()
        if self.on_close is not None:
            self.on_close()
        if loop is not None:
            loop.stop(STOP_WAIT_S)

    # -- start-up: warm pass and golden check (R4.3, R4.4) --------------------------------
    def startup(self, golden_rows: list[list[int]],
                reference: np.ndarray | None = None, tolerance: float = 1e-5) -> str | None:
        """Warm, then check the golden answers at the configured count; unlock exploration
        (and start the shadow thread) when they hold. Returns why the worker must stay out of
        dispatch, or None."""
        batches = [pad([row]) for row in golden_rows]
        self.forward(batches[0], self.configured)  # warm pass: caches out of the comparison
        # flat: per-token answers (token classification) differ in length per input; the
        # bytes, and so the digest, of vector answers are unchanged by flattening
        outputs = np.concatenate([self.forward(b, self.configured).outputs.reshape(-1)
                                  for b in batches])
        digest = hashlib.sha256(output_bits(outputs).tobytes()).hexdigest()[:32]
        stored = self.sync.guard("read_golden", lambda rec: rec.golden(self.scope))
        if stored is None:
            if reference is not None and (err := float(
                    np.abs(outputs - reference.reshape(-1)).max())) \
                    > tolerance:
                self.locked_reason = (f"golden check failed: answers differ from the "
                                      f"artifact's reference outputs by {err:.2e} "
                                      f"(tolerance {tolerance:.0e})")
                return self.locked_reason
            self.sync.guard("write_golden", lambda rec: rec.put_golden(self.scope, digest))
        elif stored != digest:
            self.locked_reason = (
                f"golden check failed: answers at {self.configured} threads differ from this "
                f"host's record (digest {digest[:12]} vs stored {stored[:12]}); learning and "
                "serving stay off until `vllm-srun threads reset`")
            return self.locked_reason
        if self.mode is AdaptiveMode.SERVE:  # mode 2 may serve the others: warm them too
            for n in self.counts:
                if n != self.configured:
                    self.forward(batches[0], n)
        self.locked_reason = None
        self.budget.restart(self.clock())
        if self.settings.background and self.retired is None:
            self._loop = ShadowLoop(self, batches[0])
            self.freezer.start()
            self.sync.watch(self.poll_record, self.settings.watch_s, self.worker)
        log.info("threads_golden_passed mode=%d configured=%d counts=%s retired=%s",
                 self.mode, self.configured, list(self.counts), self.retired is not None)
        return None

    # -- ThreadsPolicy ---------------------------------------------------------------------
    def served_threads(self, batch: TokenBatch) -> int:
        """The count for a served forward about to start (it counts as running from now):
        the count its range's state wants (``ranges.wanted_count``), where the exactness
        ledger admits it for this forward's shape (``ExactnessLedger.may_serve``, the only
        gate), else the configured count. A forward of a range still exploring is a timing
        sample: the shadow side is frozen (``pause_shadows``) while it runs, or else its
        time counts only if no shadow ran beside it. Mode 2 with a voucher: such a range
        serves a count it lacks samples for, in turn (vouched exploration, R4.8)."""
        with self.lock:
            self.gate.served_started(self.clock(), first=not self._busy)
            self._busy += 1
            self._epoch += 1
            lo = size_range(batch.padded_tokens)[0]
            r = self.ranges.get(lo)
            learning = self.ledger.learning
            wanted = n = wanted_count(r, self.configured) if learning else self.configured
            contention = None
            if learning and r is not None and r.serving and n == r.learned:
                n, contention = self.contention.under_contention(lo, r, self.ledger.vouches_for)
                if contention == "relearn":
                    self._relearn(lo, r, None)
                    n, contention, r = self.configured, None, self.ranges[lo]
            exploring = learning and r is not None and r.exploring
            if exploring and self.mode is AdaptiveMode.SERVE and self.voucher.vouches:
                if not r.explore_served:  # vouched: time each count on served forwards
                    r.explore_served = True
                    log.info("threads_explore_served range=%d-%d", lo, 2 * lo - 1)
                now = self.clock()  # a count whose cores other tasks hold waits
                n = self._explore_count(r, n, [k for k in self._need(r)
                                               if not self.contention.cores_busy(now, k)])
            # vouched exploration and a contention fallback need the voucher, not a window
            verdict = self.ledger.may_serve(lo, n, batch.rows, int(batch.input_ids.shape[1]),
                                            explore=n != wanted)
            if not verdict.allowed:
                self.tally.uncovered += verdict.refusal is Refusal.UNCOVERED  # R4.8: the shape
                n = self.configured
            elif contention == "fallback":
                self.tally.contended += 1
            elif contention == "probe":
                self.tally.contention_probes += 1
            elif n != wanted:
                self.tally.explored += 1
            self._timed[id(batch)] = self._freeze_for(n, sampling=r is None or exploring,
                                                      contention=contention)
            return n

    def _freeze_for(self, n: int, sampling: bool, contention: str | None
                    ) -> tuple[bool, bool, int, str | None, bool]:
        """Freeze the shadow side for a served forward at ``n`` about to start, if a shadow
        runs and this forward is timed (``sampling``), or a timing shadow that waited for a
        gap runs on cores this forward needs (their sum over the budget): an idle-class
        shadow sharing its cores made served forwards 1.5x slower here, one beside them not
        at all. Comparisons are not frozen for served forwards that are not timed: under
        back-to-back load they would never end, and mode 2 needs them; nor is a paid shadow
        (the learning share pays for it to run beside served forwards). With no shadow
        running there is nothing to freeze (a freeze wakes each of the child's sleeping
        threads to stop it, and again to thaw it). Returns what ``observe`` reads back."""
        sharing = self._shadowing and self._shadow_gated and \
            self._shadow_threads + n > max(self.counts)
        want = self.freezer.available and bool(self._shadowing) and \
            not self._shadow_paid and bool(sampling or sharing) and \
            not self._shadow_starved(self.clock())
        frozen = self.freezer.served_started(want)
        self.tally.frozen_beside += frozen and bool(sharing)
        return (frozen, frozen or not self._shadowing, self._shadow_epoch, contention,
                sampling)

    def _shadow_starved(self, now: float) -> bool:
        """The shadow in flight belongs to a range whose payable work made no progress for
        ``starved_s``: timed served forwards no longer freeze it. Under back-to-back load each
        of them froze it, so it never ended, and while it held the shadow process no paid
        pass could start either (a 16-connection mode 2 without a voucher: 3,249 freezes and
        no comparison in 120 s). Unfrozen, it runs in the idle class beside served forwards
        and ends: its time is no sample (a served forward overlapped it), its comparison
        still counts, and the learning share may pay for the next."""
        since = self.board.starved_since.get(self._shadow_lo)
        return since is not None and now - since >= self.settings.starved_s

    def _explore_count(self, r: RangeLearning, serving: int, need: list[int]) -> int:
        """The count with the fewest samples among those a range needs now (ties: the one
        nearest the count it serves); when it may time none now (other tasks hold their
        cores), the vouched count fastest so far (``serving`` before any has a few
        samples)."""
        if not need:
            known = [n for n in self.counts if len(r.samples.get(n, ())) >= 3
                     and self.voucher.covers_counts(n, self.configured)]
            return min(known, key=lambda n: (typical(r.samples[n]), n != serving, n)) \
                if known else serving
        return min(need, key=lambda n: (len(r.samples.get(n, ())),
                                        abs(n.bit_length() - serving.bit_length()), n))

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None:
        """A served forward ended (``None``: it failed)."""
        with self.lock:
            self._busy = max(0, self._busy - 1)
            self._epoch += 1
            now = self.clock()
            wake = self.gate.served_ended(now, not self._busy, result)
            if result is not None:
                self.paid.accrue(result.forward_s)
            timed = self._timed.pop(id(batch), (False, False, -1, None, False))
            if timed[0]:
                self.freezer.served_ended(lambda: self.gate.thaw_hold_s(
                    self._shadow_gated and bool(self._shadowing), self.clock()))
            if self.board.jobs and wake:
                self.lock.notify_all()  # the shadow loop waits for no served forward to run
            if result is None or self.locked_reason is not None or self.retired is not None:
                return
            self.idle_verifier.note(batch)
            lo = size_range(batch.padded_tokens)[0]
            r = self.ranges.setdefault(lo, RangeLearning())
            s = self.settings
            if r.learned is not None:
                per_token = result.forward_s * 1000 / batch.padded_tokens
                if (base := r.baselines.get((result.num_threads, "shadow"))) is not None:
                    self.contention.note_slowdown(result.num_threads, per_token / base,
                                                  timed[3] == "probe")
                if timed[3] is None and r.phase is not Phase.VERIFYING and not (
                        r.serving and result.num_threads == r.learned > min(self.counts)):
                    # a served count that contention can fall back from relearns by
                    # ``contention_relearn_s`` instead (a brief neighbour: no relearning);
                    # a range in its transition window is not relearned on the count it
                    # serves meanwhile (a neighbour that comes and goes restarted it, again
                    # and again, before it could pass)
                    self._watch(lo, r, (result.num_threads, "served"), per_token,
                                s.relearn_window)
                r = self.ranges[lo]
            elif timed[4] and (timed[0] or (timed[1] and timed[2] == self._shadow_epoch)):
                # shadows frozen, or none ran beside it: clean, unless other tasks held
                # the cores it needed
                if self.contention.cores_busy(now, result.num_threads):
                    self.tally.samples_cores_busy += 1
                else:
                    self.tally.served_samples += 1
                    self._sample(lo, r, result.num_threads, result.forward_s * 1000,
                                 batch.padded_tokens)
                    r = self.ranges[lo]
            need = self._need(r) if r.exploring else []
            if r.learned is not None:
                r.served_at_learned += 1
            window_due = self.ledger.window_due(lo, r.learned)
            counts = shadow_plan(need, window_due, r.learned, result.num_threads,
                                 self.counts, r.served_at_learned, s.audit_every)
            if r.serving and timed[3] is None and result.num_threads == self.configured \
                    and r.learned not in counts and r.learned != self.configured:
                counts = [r.learned, *counts]  # a shape no voucher covers yet: verify it
            if r.learned is None and result.num_threads != self.configured:
                # served at another count while exploring: audit its answer at the
                # configured one (only that, where served forwards are the samples)
                counts = [self.configured] + ([] if r.explore_served else [
                    n for n in counts if n != self.configured])
            if counts:
                # the newest batch of a range goes to the back
                job = ShadowJob(batch, result.outputs, result.num_threads, counts, result.forward_s)
                self.board.put(lo, job)
                if any(self._payable(lo, job, n) for n in counts):
                    self.board.starved_since.setdefault(lo, now)
                self.gate.waiting_gap = False
                self.lock.notify_all()

    def shadow_budget_s(self) -> float:
        """Idle-class shadow time allowed so far (``share.ShadowBudget``: what shadows ran
        may not pass it)."""
        with self.lock:
            return self.budget.allowed_s(self.clock())

    def _toward_window(self, lo: int, job: ShadowJob) -> bool:
        """``job``'s one comparison would count toward a transition window still open
        (``ExactnessLedger.toward_window``)."""
        r = self.ranges.get(lo)
        return len(job.counts) == 1 and r is not None and self.ledger.toward_window(
            lo, job.served_threads, job.counts[0], r.learned)

    def _payable(self, lo: int, job: ShadowJob, count: int) -> bool:
        """A shadow the learning share may pay for: it times a count its exploring range
        lacks samples of, or compares toward a transition window still open (R4.5 amended;
        not audits of what a range serves, nor probes)."""
        r = self.ranges.get(lo)
        return r is not None and ((r.exploring and count in self._need(r)) or
                                  self.ledger.toward_window(lo, job.served_threads, count,
                                                            r.learned))

    # -- shadows ---------------------------------------------------------------------------
    def pending_shadows(self) -> int:
        """Size ranges with shadow passes still to run."""
        return len(self.board)

    def step(self) -> bool:
        """Run one due shadow forward on the calling thread (the shadow loop, or a test).
        An idle-class one starts only while no served forward runs and within its budget
        (``ShadowGate.next_shadow``); else a starved one the learning share affords runs paid
        (``_paid_shadow``). False when none may start now."""
        with self.lock:
            if not self.ledger.learning or not self.board.jobs:
                return False
            now = self.clock()
            due = None if self._busy or self.budget.over(now) else \
                self.gate.next_shadow(now, self.board.jobs, self.ranges, self.mode)
            self.gate.waiting_gap = due is None
            paid = due is None and (due := self._paid_shadow(now)) is not None
            if due is None:
                return False
            lo, job, count, sharing = due
            epoch = self._epoch
            self._shadow_gated, self._shadow_paid, self._shadow_lo = sharing, paid, lo
            began = self.clock()
            frozen_before = self.freezer.frozen_total(began)
        try:
            result = self.run_shadow(job.batch, count, paid)
        except RuntimeFault:
            # the shadow side failed (the loop counts it and backs off): not this batch
            # again, the range's next served batch brings its counts
            with self.lock:
                self.board.failed(lo, job)
            raise
        finally:
            with self.lock:
                self._shadow_paid = False
        with self.lock:
            now = self.clock()
            wall = now - began
            self.shadow_wall_s += wall
            waited = (result.waited_s or 0.0) / max(1, count)
            if paid:  # timed beside served forwards: its cost to one (``served_cost_ms``)
                self.paid.charge(max(0.0, wall - waited))
                self._after_shadow(lo, job, count, result, clean=True, paid=True)
                return True
            self.budget.charge(wall - (self.freezer.frozen_total(now) - frozen_before) - waited,
                               now)
            clean, before = clean_window(0, epoch, self._epoch), self.tally.preempted
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
            self._after_shadow(lo, job, count, result, clean,
                               retry=sharing or self.tally.preempted == before)
        return True

    def _paid_shadow(self, now: float) -> tuple[int, ShadowJob, int, bool] | None:
        """The first due shadow, ranges oldest first, that the learning share may pay for
        now: its range made no progress for ``starved_s`` (no idle CPU let one run), it is
        payable (``_payable``), the share affords its expected cost, and no timed served
        forward holds the shadow side frozen (it would run nothing)."""
        if self.freezer.running:
            return None
        for lo, job in self.board.jobs.items():
            since = self.board.starved_since.get(lo)
            if since is None or now - since < self.settings.starved_s:
                continue
            for count in job.counts:
                if self._payable(lo, job, count) and \
                        self.paid.affords(self._expected_s(lo, job, count)):
                    self.freezer.release()  # held frozen since the last forward
                    return lo, job, count, False
        return None

    def _expected_s(self, lo: int, job: ShadowJob, count: int) -> float:
        """How long a shadow of ``job`` at ``count`` will likely take: the count's samples in
        its range, else the served forward's time scaled by the counts' ratio."""
        r = self.ranges.get(lo)
        known = r.samples.get(count) if r is not None else None
        return typical(known) / 1000 if known else job.served_s * job.served_threads / count

    def run_shadow(self, batch: TokenBatch, count: int, paid: bool = False) -> ForwardResult:
        """One shadow forward (a due one, or a warm-up), counted as running meanwhile;
        ``paid``: on the shadow side at normal priority (``paid_forward``)."""
        with self.lock:
            self._shadowing += 1
            self._shadow_epoch += 1
            self._shadow_threads = count
        try:
            return (self.paid_forward if paid else self.shadow_forward)(batch, count)
        finally:
            with self.lock:
                self._shadowing -= 1
                self._shadow_epoch += 1

    def _after_shadow(self, lo: int, job: ShadowJob, count: int, result: ForwardResult,
                      clean: bool, retry: bool = True, paid: bool = False) -> None:
        """A shadow ended: the ledger compares it with the served answer (a difference is
        drift); a clean one is a sample (what it would cost a served forward:
        ``estimator.served_cost_ms``); the range's state moves on."""
        if not self.ledger.learning:
            return
        if (at := first_difference(job.outputs, result.outputs)) is not None:
            self._drift(job, count, result, at)
            return
        self.ledger.agree(lo, job.served_threads, count)
        self.sync.pending.comparisons += 1
        if job.served_threads != count and self.configured in (job.served_threads, count):
            other = count if job.served_threads == self.configured else job.served_threads
            self.sync.pending.shapes.add((*job.batch.input_ids.shape, other))  # this shape
        r = self.ranges.setdefault(lo, RangeLearning())
        progress = self.ledger.toward_window(lo, job.served_threads, count, r.learned)
        if clean:
            progress |= r.exploring and count in self._need(r)
            self._sample(lo, r, count, served_cost_ms(result.forward_s, result.waited_s, count),
                         job.batch.padded_tokens)
        if progress or paid:  # the share pays again only after ``starved_s`` more
            self.board.starved_since.pop(lo, None)
        r = self.ranges[lo]
        if count in job.counts:
            job.counts.remove(count)
        if retry and r.exploring and count in self._need(r):
            job.counts.append(count)  # still due: this batch (a shape load made) runs again
            # (if not ``retry``, after it waited for CPUs other tasks held: they likely
            # still do; the range's next served batch brings the count again)
        self.sync.pending.learned.add(lo)
        self._settle(lo, r)  # (a range that starts serving needs its backlog no more)
        self.board.ran(lo, job)

    def _need(self, r: RangeLearning) -> list[int]:
        """Counts an exploring range still lacks ``min_samples`` of."""
        return counts_needing_samples(r.samples, self.counts, self.settings.min_samples)

    def _sample(self, lo: int, r: RangeLearning, count: int, ms: float, tokens: int) -> None:
        keep = self.settings.max_samples
        for store, value in ((r.samples, ms), (r.per_token, ms / tokens)):
            kept = store.setdefault(count, [])
            kept.append(value)
            del kept[:-keep]
        self.sync.pending.samples.setdefault((lo, count), []).append(ms)
        if r.exploring:
            self._update(lo, r)
        else:
            self._watch(lo, r, (count, "shadow"), ms / tokens, self.settings.probe_window)

    def _update(self, lo: int, r: RangeLearning) -> None:
        """An exploring range took a sample: learn a count once the estimator chooses one
        (``estimator.choose``)."""
        s = self.settings
        new = choose(r.samples, self.counts, self.configured, s.min_samples, s.margin)
        if new is None:
            return
        learn(r, new, self.configured, self.mode is AdaptiveMode.SERVE,
              self.ledger.may_serve_range(lo, new))
        r.baselines = {(n, "shadow"): typical(v) for n, v in r.per_token.items()}
        r.recent = {}
        self.sync.pending.learned.add(lo)
        log.info("threads_learned range=%d-%d num_threads=%d speedup=%.3f", lo, 2 * lo - 1,
                 new, self._speedup(r))
        if r.serving:
            self._serving(lo, r)

    def _settle(self, lo: int, r: RangeLearning) -> None:
        """Mode 2: the range starts serving its learned count once the ledger admits it (its
        window passed, vouched), and stops while it does not (the voucher withdrawn)."""
        if r.learned is not None and settle(r, self.ledger.may_serve_range(lo, r.learned)):
            self._serving(lo, r)

    def _serving(self, lo: int, r: RangeLearning) -> None:
        self.board.backlog.pop(lo, None)
        log.info("threads_serving_learned range=%d-%d num_threads=%d verified_passes=%d",
                 lo, 2 * lo - 1, r.learned, self.ledger.progress(lo, r.learned))

    def _speedup(self, r: RangeLearning) -> float:
        a, b = r.samples.get(self.configured), r.samples.get(r.learned or self.configured)
        return typical(a) / typical(b) if a and b else 1.0

    def _watch(self, lo: int, r: RangeLearning, key: tuple[int, str], per_token_ms: float,
               window: int) -> None:
        """R4.11, the change detector (``estimator.changed``): forwards at one count against
        forwards at that same count when the range was learned, like against like: probe
        shadows (clean, SCHED_IDLE) against the samples it was learned from; served forwards
        against the first ``window`` served after it was learned. A learned count far faster
        than the configured one never triggers it; a neighbour that arrives slows the served
        count, one that leaves speeds up a probe."""
        recent = r.recent.setdefault(key, [])
        recent.append(per_token_ms)
        if len(recent) < window:
            return
        r.recent[key] = []
        baseline = r.baselines.get(key)
        if baseline is None:
            r.baselines[key] = typical(recent)
            return
        if changed(recent, baseline, self.settings.relearn_factor):
            log.info("threads_relearn range=%d-%d num_threads=%d forwards=%s ratio=%.2f",
                     lo, 2 * lo - 1, key[0], key[1], typical(recent) / baseline)
            # a probe moved: the verified count serves on meanwhile; not if it slowed
            self._relearn(lo, r, r.learned if r.serving and key[1] == "shadow" else None)

    def _relearn(self, lo: int, r: RangeLearning, keep_serving: int | None) -> None:
        self.ranges[lo] = relearn(r, keep_serving)
        self.contention.forget(lo)
        self.board.forget(lo)

    def _drift(self, job: ShadowJob, count: int, result: ForwardResult,
               at: tuple[int, ...]) -> None:
        event = DriftEvent(job.batch.padded_tokens, job.served_threads, count, at,
                           float(job.outputs[at]), float(result.outputs[at]), time.time(),
                           job.batch.rows, self.worker)
        self._retire(event)
        log.warning("threads_drift worker=%s rows=%d padded_tokens=%d served_threads=%d "
                    "shadow_threads=%d first_index=%s served=%r shadow=%r", self.worker,
                    event.rows, event.padded_tokens, event.served_threads, count, list(at),
                    event.served_value, event.shadow_value)
        self.sync.guard("write_drift", lambda rec: rec.record_drift(self.scope, event))
        self.sync.guard("write_voucher", lambda rec: rec.add_voucher(self.scope, "traffic", 1, 1))

    def _retire(self, event: DriftEvent) -> None:
        """Learning ends for good (R4.7): the ledger admits only the configured count."""
        self.ledger.retire(event)
        self.board.clear()
