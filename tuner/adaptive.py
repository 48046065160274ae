"""Adaptive threads (R4.3-R4.7, R4.11): learn the fastest intra-op count per input-size range
from timed shadow passes that must reproduce the served answer bit for bit.

How it works: the engine asks ``served_threads`` right before each served forward and tells
``observe`` right after it ends. A served batch becomes a shadow job (the latest per size
range) listing the counts still to run on it (``policy.shadow_plan``). Jobs run in a process
of the tuner's own in ``SCHED_IDLE`` (``ShadowLoop`` hands them over): the kernel gives shadows
only CPU time no served forward wants, and no lock a served forward needs is held across a
shadow. A shadow starts only while no served forward runs; if one ran at any moment of it, its
time is not a sample (``policy.clean_window``), nor is it if its threads waited for CPUs that
any other task held (``policy.preempted``: the frontend, a neighbour, another worker's load);
the count stays due, so the batch is run again later.

Idle class is not free where a shadow shares cores with served work (its count plus the served
one over the budget): here a 2-thread idle-class shadow beside 1-thread served forwards made
them 1.5x slower, a 1-thread one not at all. So a shadow that only times a count on such
cores starts only when the worker has been idle long enough that the next served forward will
likely not cut in (recent idle gaps; ``_quiet_s`` doubles each time one was cut in on and
halves each second), and a served forward that cuts in freezes it (held frozen a few ms
after, in case the next one follows at once): under closed-loop load, where every gap is a
client's turnaround, such shadows wait for the load to pause instead of being started, frozen
and thrown away.
Comparisons (mode 2's window, audits of what exploring served) run whenever no served forward
does, unfrozen; audits of a range serving its learned count wait for a gap too, but run at
least every ``audit_floor_s``. A newer batch of a range replaces its older one, except that
batches whose comparison counts toward mode 2's window wait in a backlog of up to ``window``
(``_backlog_job``): under bursts of load the first lull passes the whole window.

Served forwards are samples too: while a range explores, each of its served forwards is timed
at the count it ran at, with the shadow process frozen (``pause_shadows``: SIGSTOP) for its
length, or, where nothing can freeze it, only if no shadow ran beside it. Other served forwards
leave shadows running beside them in ``SCHED_IDLE`` (freezing for every forward was measured
to cost more served latency than it saved). Mode 2 with a voucher: a range still exploring
serves the counts it lacks samples for, in turn, where the voucher covers count and shape (the
answer is the same at every vouched count; a shadow audits it at the configured count), so it
times each count as served traffic runs it (normal priority, beside whatever the host runs;
an idle-class shadow beside a CPU-bound neighbour gets no CPU and times badly), needs no gap,
and every range that load keeps reaching is learned while the load lasts. The shadows at a
count that matched served answers while the range explored count toward its window.

Every shadow, timed or not, is compared bit for bit with the served answer. Equal: a
comparison (and mode 2's transition window moves on). Any difference is drift: learning
retires for good for this scope (stored durably) and every range serves the configured count.

A count is learned once every allowed count has ``min_samples`` clean samples; it then stays
until relearning (R4.11): forwards at each count are compared with forwards at that same
count when the range was learned (every ``audit_every``-th served forward gets a probe shadow
at another count, in turn, compared with the samples it was learned from; served forwards
with the first ones served after learning), and a range where one count's time moved by
``relearn_factor`` either way explores again from fresh samples (when a probe moved, mode 2
goes on serving the count it had verified until the new one passes its window; when the
served count itself moved, it serves the configured count meanwhile; a count that passed its
window for the range in this worker serves at once when relearnt). A new worker starts from
fresh samples too; the record keeps the old ones as history, and its drift and voucher hold.

Drift is host-wide (R4.8): a ``RecordWatch`` thread of the tuner's own reads the record's
drift and voucher every ``watch_s``, so a drift any worker of the scope recorded retires this
one too, within a second; a served forward only reads the tuner's own fields.

Invariant: mode 1 serves every forward at the configured count; mode 2 serves a learned count
for a forward only while the record vouches for that count and that forward's shape (rows x
padded length; R4.8), the count passed ``window`` consecutive verified shadows, and no drift
was seen by any worker of the scope.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from vllm_srun.records.host_record import DriftEvent, HostRecord, HostRecordError, Scope
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
from vllm_srun.tuner.ledger import ExactnessLedger, Refusal, first_difference, output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import clean_window, preempted, shadow_plan
from vllm_srun.tuner.ranges import Phase, RangeLearning, learn, relearn, settle, wanted_count
from vllm_srun.tuner.scheduling import ShadowGate, ShadowJob
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.shadows import STOP_WAIT_S, ShadowLoop
from vllm_srun.tuner.share import PaidShare, ShadowBudget

__all__ = ["AdaptiveThreads", "RangeLearning", "TunerSettings", "output_bits"]

log = logging.getLogger(__name__)

Forward = Callable[[TokenBatch, int], ForwardResult]


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
        self.scope, self.record, self.forward = scope, record, forward
        self.shadow_forward = shadow_forward or forward
        # a shadow the learning share pays for: the shadow side at normal priority
        self.paid_forward = paid_forward or self.shadow_forward
        self.settings = settings or TunerSettings()
        self.clock = clock
        self.on_close = on_close
        # freezes (True) and thaws; says if it is frozen (``_pause``: how long it was)
        self._pause_raw = pause_shadows
        self.pause_shadows = self._pause if pause_shadows is not None else None
        self.worker = worker or f"pid {os.getpid()}"  # named in the drift it records
        self.ledger = ExactnessLedger(mode, configured, self.settings.window)
        self.record_error: str | None = None
        self.shadow_error: str | None = None
        self.shadow_faults = 0  # shadow forwards that failed (a ShadowProcess restarts)
        self.ranges: dict[int, RangeLearning] = {}
        self.discarded = 0  # shadows whose time overlapped a served forward
        self.preempted = 0  # shadows whose threads waited for CPUs other tasks held
        self.uncovered = 0  # forwards kept at the configured count: the voucher lacks the shape
        self.lock = threading.Condition()  # bookkeeping only: never held across a forward
        self._jobs: dict[int, ShadowJob] = {}
        # range -> older batches whose comparison would count toward mode 2's transition
        # window, newest last (``_backlog_job``): they run once the range's job is done
        self._backlog: dict[int, deque[ShadowJob]] = {}
        # range -> since when its due shadows that the learning share may pay for made no
        # progress (``starved_s``)
        self._starved_since: dict[int, float] = {}
        self.paid = PaidShare(self.settings.learning_share)
        self._shadow_paid = False  # the shadow running now is a paid one: never frozen
        self._busy = 0  # served forwards running now
        self._epoch = 0  # served forwards started plus ended
        self._shadowing = 0  # shadow forwards running now
        self._shadow_epoch = 0  # shadow forwards started plus ended
        # served forwards running: id(batch) -> (it froze the shadow side, no shadow could
        # run at its start, shadow epoch then, contention's reason, it may be a sample)
        self._timed: dict[int, tuple[bool, bool, int, str | None, bool]] = {}
        self._paused = 0  # served forwards running with the shadow side frozen
        self._held = False  # ... none now, but it stays frozen until ``_thaw_at``
        self._thaw_at = 0.0
        self._thaw_wake = threading.Condition(self.lock)
        self._thawer: Thawer | None = None
        self._shadow_threads = 0  # the count of the shadow running now
        self._shadow_gated = False  # ... it waited for a gap (``_next_shadow``)
        self.shadows_warm = False  # the shadow loop has run every count once
        self.gate = ShadowGate(self.settings, configured, max(self.counts), clock)
        self.frozen_beside = 0  # served forwards that froze a shadow sharing their cores
        self.replaced = 0  # shadow batches a newer batch of their range replaced, not run
        self.served_samples = 0  # samples taken from served forwards
        self.explored = 0  # mode 2: forwards served at a vouched count to time it
        self.contended = 0  # mode 2: forwards served below the learned count under contention
        self.contention_probes = 0  # ... and at the learned count meanwhile, to see it end
        self.contention = ContentionWatch(self.settings, self.counts, clock, free_cpu_s)
        self.samples_cores_busy = 0  # served samples not kept: other tasks held their cores
        # idle-class shadow time charged to ``budget_fraction``: a shadow's wall time less
        # what it spent frozen (``_frozen_s``, ``_frozen_at``: SIGSTOP) or waiting for CPUs
        # (its threads' run delay, per thread): a shadow frozen through a burst of load took
        # no CPU, and charged its wall time, one held frozen through 16-connection bursts
        # spent the budget for minutes (mode 2: 0-1 window passes per range in 2 minutes,
        # 0.68x fixed 2 at 16 connections)
        self.budget = ShadowBudget(self.settings.budget_fraction, self.settings.budget_window_s,
                                   clock())
        self.shadow_wall_s = 0.0  # ... and what they took in wall time
        self._frozen_s, self._frozen_at = 0.0, None  # frozen so far; since when, if frozen
        self._last_flush = clock()
        self._dirty_samples: dict[tuple[int, int], list[float]] = {}
        self._dirty_learned: set[int] = set()
        self._unflushed_comparisons = 0
        self._loop: ShadowLoop | None = None
        self._record_watch: RecordWatch | None = None
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
    # contention's, as the report and the simulator read them
    contention_freed = property(lambda self: self.contention.freed)
    slow_cores_free = property(lambda self: self.contention.slow_cores_free)
    free_cpu_s = property(lambda self: self.contention.free_cpu_s,
                          lambda self, v: setattr(self.contention, "free_cpu_s", v))

    # -- the record ----------------------------------------------------------------------
    def _guard(self, what: str, fn: Callable[[], object]) -> object | None:
        if self.record is None:
            return None
        try:
            return fn()
        except HostRecordError as exc:
            self.record_error = str(exc)
            log.error("host_record_failed action=%s error=%s", what, exc)
            return None

    def _load(self) -> None:
        """Drift retirement and the voucher survive a restart; stored samples and learned
        counts are history: a new worker learns from fresh samples (R4.11)."""
        record = self.record
        if record is None:
            return
        event = self._guard("read_drift", lambda: record.drift(self.scope))
        if event is not None:
            self.ledger.retire(event)
        self.voucher = self._guard("read_voucher", lambda: record.voucher(self.scope)) or \
            self.voucher

    def flush(self) -> None:
        """Write pending samples, learned counts and traffic comparisons to the record."""
        record = self.record
        with self.lock:
            self._last_flush = self.clock()
            samples, self._dirty_samples = self._dirty_samples, {}
            learned = {lo: (r.learned, self._speedup(r), self.ledger.progress(lo, r.learned))
                       for lo in self._dirty_learned if (r := self.ranges[lo]).learned}
            self._dirty_learned = set()
            comparisons, self._unflushed_comparisons = self._unflushed_comparisons, 0
        if record is None:
            return

        def write() -> None:
            for (lo, n), ms in samples.items():
                record.add_samples(self.scope, lo, n, ms)
            for lo, (n, up, streak) in learned.items():
                record.put_learned(self.scope, lo, n, up, streak)
            if comparisons:
                record.add_voucher(self.scope, "traffic", comparisons, 0)

        self._guard("flush", write)

    def poll_record(self) -> None:
        """Read drift and the voucher back from the record (the watch thread): a drift any
        worker of the scope recorded retires this one; a new sweep or a reset shows here."""
        record = self.record
        if record is None or self.retired is not None:
            return
        event = self._guard("read_drift", lambda: record.drift(self.scope))
        voucher = self._guard("read_voucher", lambda: record.voucher(self.scope))
        with self.lock:
            if voucher is not None:
                self.voucher = voucher
            if event is not None and self.retired is None:
                self._retire(event)
                log.warning("threads_drift_seen_by_another worker=%s seen_by=%s rows=%d "
                            "padded_tokens=%d", self.worker, event.worker, event.rows,
                            event.padded_tokens)
            else:  # a new sweep, or a reset: ranges start or stop serving at once
                for lo, r in self.ranges.items():
                    self._settle(lo, r)

    def close(self) -> None:
        with self.lock:
            if self._paused or self._held:  # frozen: thaw before closing
                self._paused, self._held = 0, False
                self.pause_shadows(False)
        if self._thawer is not None:
            self._thawer.stop()
            self._thawer = None
        if self._record_watch is not None:
            self._record_watch.stop()
            self._record_watch = None
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
        stored = self._guard("read_golden", lambda: self.record.golden(self.scope))
        if stored is None:
            if reference is not None and (err := float(
                    np.abs(outputs - reference.reshape(-1)).max())) \
                    > tolerance:
                self.locked_reason = (f"golden check failed: answers differ from the "
                                      f"artifact's reference outputs by {err:.2e} "
                                      f"(tolerance {tolerance:.0e})")
                return self.locked_reason
            self._guard("write_golden", lambda: self.record.put_golden(self.scope, digest))
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
            if self.pause_shadows is not None:
                self._thawer = Thawer(self)
            if self.record is not None:
                self._record_watch = RecordWatch(self.poll_record, self.settings.watch_s)
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
                self.uncovered += verdict.refusal is Refusal.UNCOVERED  # R4.8: the shape
                n = self.configured
            elif contention == "fallback":
                self.contended += 1
            elif contention == "probe":
                self.contention_probes += 1
            elif n != wanted:
                self.explored += 1
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
        want = self.pause_shadows is not None and self._shadowing and \
            not self._shadow_paid and (sampling or sharing)
        if self._held:  # still frozen since the last forward: no signal either way
            self._held = False
            frozen = bool(want) or self.pause_shadows(False)
        else:
            frozen = want and self.pause_shadows(True)
        if frozen:
            self._paused += 1
            self.frozen_beside += sharing
        return (frozen, frozen or not self._shadowing, self._shadow_epoch, contention,
                sampling)

    def _pause(self, frozen: bool) -> bool:
        """``pause_shadows``, keeping the time the shadow side spent frozen."""
        now, is_frozen = self.clock(), self._pause_raw(frozen)
        if is_frozen and self._frozen_at is None:
            self._frozen_at = now
        elif not is_frozen and self._frozen_at is not None:
            self._frozen_s += now - self._frozen_at
            self._frozen_at = None
        return is_frozen

    def _frozen_total(self, now: float) -> float:
        """Seconds the shadow side has spent frozen, up to ``now``."""
        return self._frozen_s + (now - self._frozen_at if self._frozen_at is not None else 0.0)

    def _thaw(self) -> None:
        """The last served forward that froze the shadow side ended: thaw it, or, with the
        thawer running, hold it frozen for twice the recent idle gaps (at most
        ``thaw_hold_s``): under back-to-back load the next forward starts meanwhile and
        finds it frozen, instead of a thaw and a freeze per forward, each waking every
        thread of the shadow process for the few moments of CPU a gap that short gives it
        (not measured apart: with the hold, mode 2 at 16 connections went from 0.85x to
        1.04x fixed 2 in one A/B, where comparisons were no longer frozen too).

        A shadow that waited for a gap on the served forwards' cores (``_shadow_gated``)
        while served forwards take over ``busy_max`` of the time stays frozen until they
        no longer do (checked at each served forward's end, and ``busy_window_s`` after the
        last): thawed in the gaps, it would be cut into again at once, and it could not be
        a sample anyway (served forwards overlapped it). One such shadow, started in the
        quiet before a run, froze at every forward of 10-s runs of short inputs at 1
        connection, thawed in the gaps that outlasted the hold: mode 1's mean 1.04-1.28x
        fixed 1's; held frozen, 1.00-1.01x."""
        hold = self.gate.thaw_hold_s(self._shadow_gated and bool(self._shadowing), self.clock())
        if self._thawer is None or hold <= 0:
            self.pause_shadows(False)
            return
        self._held, self._thaw_at = True, self.clock() + hold
        self._thaw_wake.notify_all()

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
                self._paused -= 1
                if not self._paused:
                    self._thaw()
            if self._jobs and wake:
                self.lock.notify_all()  # the shadow loop waits for no served forward to run
            if result is None or self.locked_reason is not None or self.retired is not None:
                return
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
                    self.samples_cores_busy += 1
                else:
                    self.served_samples += 1
                    self._sample(lo, r, result.num_threads, result.forward_s * 1000,
                                 batch.padded_tokens)
                    r = self.ranges[lo]
            need = self._need(r) if r.exploring else []
            if r.learned is not None:
                r.served_at_learned += 1
            window_due = self.ledger.window_due(lo, r.learned)
            counts = shadow_plan(need, window_due, r.learned, result.num_threads,
                                 self.counts, r.served_at_learned, s.audit_every)
            if r.learned is None and result.num_threads != self.configured:
                # served at another count while exploring: audit its answer at the
                # configured one (only that, where served forwards are the samples)
                counts = [self.configured] + ([] if r.explore_served else [
                    n for n in counts if n != self.configured])
            if counts:
                # the newest batch of a range goes to the back
                job = ShadowJob(batch, result.outputs, result.num_threads, counts, result.forward_s)
                if (old := self._jobs.pop(lo, None)) is not None:
                    self._backlog_job(lo, r, old, job)
                self._jobs[lo] = job
                if any(self._payable(lo, job, n) for n in counts):
                    self._starved_since.setdefault(lo, now)
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

    def _backlog_job(self, lo: int, r: RangeLearning, old: ShadowJob, new: ShadowJob) -> None:
        """A newer batch of range ``lo`` replaced ``old`` before its shadows ran. Where both
        would count toward the range's window, ``old`` waits in the backlog (at most
        ``window`` of them), so the next quiet moment passes the whole window instead of one
        comparison: under bursts of load every batch replaced the last, one pass ran per
        lull, and ranges that 16 connections reached passed their window only after a
        minute or more, serving the configured count meanwhile (0.88x fixed 2 in the first
        10 s of 16 connections after learning, the real host). Else it is dropped."""
        if not (self._toward_window(lo, old) and self._toward_window(lo, new)):
            self.replaced += 1
            return
        backlog = self._backlog.setdefault(lo, deque(maxlen=self.settings.window))
        self.replaced += len(backlog) == backlog.maxlen  # the oldest gives way
        backlog.append(old)

    def _forget_jobs(self, lo: int) -> None:
        """Range ``lo`` explores again: its due shadows and backlog go."""
        self._jobs.pop(lo, None)
        self._backlog.pop(lo, None)
        self._starved_since.pop(lo, None)

    def _next_from_backlog(self, lo: int) -> None:
        """Range ``lo`` has no job: its newest backlogged batch that still counts toward its
        window becomes it; none: the backlog goes."""
        backlog, r = self._backlog.get(lo), self.ranges.get(lo)
        while backlog:
            job = backlog.pop()
            if job.counts and r is not None and self._toward_window(lo, job):
                self._jobs[lo] = job  # (a job that ran as it was backlogged has no count)
                return
        self._backlog.pop(lo, None)

    # -- shadows ---------------------------------------------------------------------------
    def pending_shadows(self) -> int:
        """Size ranges with shadow passes still to run."""
        return len(self._jobs)

    def step(self) -> bool:
        """Run one due shadow forward on the calling thread (the shadow loop, or a test).
        An idle-class one starts only while no served forward runs and within its budget
        (``_next_shadow``); else a starved one the learning share affords runs paid
        (``_paid_shadow``). False when none may start now."""
        with self.lock:
            if not self.ledger.learning or not self._jobs:
                return False
            now = self.clock()
            due = None if self._busy or self.budget.over(now) else \
                self.gate.next_shadow(now, self._jobs, self.ranges, self.mode)
            self.gate.waiting_gap = due is None
            paid = due is None and (due := self._paid_shadow(now)) is not None
            if due is None:
                return False
            lo, job, count, sharing = due
            epoch = self._epoch
            self._shadow_gated, self._shadow_paid = sharing, paid
            began = self.clock()
            frozen_before = self._frozen_total(began)
        try:
            result = self.run_shadow(job.batch, count, paid)
        except RuntimeFault:
            # the shadow side failed (the loop counts it and backs off): not this batch
            # again, the range's next served batch brings its counts
            with self.lock:
                if self._jobs.get(lo) is job:
                    del self._jobs[lo]
            raise
        finally:
            with self.lock:
                self._shadow_paid = False
        with self.lock:
            now = self.clock()
            wall = now - began
            self.shadow_wall_s += wall
            if paid:  # timed beside served forwards: its cost to one (``served_cost_ms``)
                self.paid.charge(wall)
                self._after_shadow(lo, job, count, result, clean=True, paid=True)
                return True
            waited = (result.waited_s or 0.0) / max(1, count)
            self.budget.charge(wall - (self._frozen_total(now) - frozen_before) - waited, now)
            clean, before = clean_window(0, epoch, self._epoch), self.preempted
            if not clean:
                self.discarded += 1
            elif preempted(result.forward_s, result.waited_s):
                self.preempted += 1
                clean = False
            if sharing:
                self.gate.after_sharing(result, clean, self.preempted != before, self.clock())
            # a preempted one is not run again on this batch, unless it shares cores with
            # served forwards: then ``_quiet_s`` and the backoff space its tries out (the load
            # may be over; idle time alone does not: a worker with no traffic is always idle)
            self._after_shadow(lo, job, count, result, clean,
                               retry=sharing or self.preempted == before)
        return True

    def _paid_shadow(self, now: float) -> tuple[int, ShadowJob, int, bool] | None:
        """The first due shadow, ranges oldest first, that the learning share may pay for
        now: its range made no progress for ``starved_s`` (no idle CPU let one run), it is
        payable (``_payable``), the share affords its expected cost, and no timed served
        forward holds the shadow side frozen (it would run nothing)."""
        if self._paused:
            return None
        for lo, job in self._jobs.items():
            since = self._starved_since.get(lo)
            if since is None or now - since < self.settings.starved_s:
                continue
            for count in job.counts:
                if self._payable(lo, job, count) and \
                        self.paid.affords(self._expected_s(lo, job, count)):
                    if self._held:  # frozen since the last forward: a paid one runs
                        self._held = False
                        self.pause_shadows(False)
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
        self._unflushed_comparisons += 1
        r = self.ranges.setdefault(lo, RangeLearning())
        progress = self.ledger.toward_window(lo, job.served_threads, count, r.learned)
        if clean:
            progress |= r.exploring and count in self._need(r)
            self._sample(lo, r, count, served_cost_ms(result.forward_s, result.waited_s, count),
                         job.batch.padded_tokens)
        if progress or paid:  # the share pays again only after ``starved_s`` more
            self._starved_since.pop(lo, None)
        r = self.ranges[lo]
        if count in job.counts:
            job.counts.remove(count)
        if retry and r.exploring and count in self._need(r):
            job.counts.append(count)  # still due: this batch (a shape load made) runs again
            # (if not ``retry``, after it waited for CPUs other tasks held: they likely
            # still do; the range's next served batch brings the count again)
        if not job.counts and self._jobs.get(lo) is job:
            del self._jobs[lo]
        self._dirty_learned.add(lo)
        self._settle(lo, r)
        if lo not in self._jobs and lo in self._backlog:
            self._next_from_backlog(lo)

    def _need(self, r: RangeLearning) -> list[int]:
        """Counts an exploring range still lacks ``min_samples`` of."""
        return counts_needing_samples(r.samples, self.counts, self.settings.min_samples)

    def _sample(self, lo: int, r: RangeLearning, count: int, ms: float, tokens: int) -> None:
        keep = self.settings.max_samples
        for store, value in ((r.samples, ms), (r.per_token, ms / tokens)):
            kept = store.setdefault(count, [])
            kept.append(value)
            del kept[:-keep]
        self._dirty_samples.setdefault((lo, count), []).append(ms)
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
        self._dirty_learned.add(lo)
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
        self._backlog.pop(lo, None)
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
        self._forget_jobs(lo)

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
        record = self.record
        self._guard("write_drift", lambda: record.record_drift(self.scope, event))
        self._guard("write_voucher", lambda: record.add_voucher(self.scope, "traffic", 1, 1))

    def _retire(self, event: DriftEvent) -> None:
        """Learning ends for good (R4.7): the ledger admits only the configured count."""
        self.ledger.retire(event)
        self._jobs.clear()
        self._backlog.clear()
        self._starved_since.clear()


class Thawer:
    """The tuner's thread that thaws a held shadow side once its hold ends (``_thaw``)."""

    def __init__(self, tuner: AdaptiveThreads) -> None:
        self.tuner, self._stop = tuner, False
        self.thread = threading.Thread(target=self._run, name="shadow-thaw", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.tuner
        with t.lock:
            while not self._stop:
                if not t._held:
                    t._thaw_wake.wait()
                elif (left := t._thaw_at - t.clock()) > 0:
                    t._thaw_wake.wait(left)
                else:
                    t._held = False
                    t.pause_shadows(False)

    def stop(self) -> None:
        with self.tuner.lock:
            self._stop = True
            self.tuner._thaw_wake.notify_all()
        self.thread.join(timeout=10)


class RecordWatch:
    """The tuner's record-reading thread: ``poll`` every ``interval_s`` until stopped."""

    def __init__(self, poll: Callable[[], None], interval_s: float) -> None:
        self._poll, self._interval_s = poll, interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="record-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._poll()
            except Exception:  # a read that fails is retried at the next interval
                log.exception("record_watch_failed")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
