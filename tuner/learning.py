"""Each size range's learning (R4.5, R4.6, R4.11): its state (``ranges.RangeLearning``), its
due shadow work (``jobs.JobBoard``), and the steps that move them on a sample, a comparison
or a change (``Learner``). The tuner (``adaptive.AdaptiveThreads``) calls them with its lock
held; nothing here runs a forward or decides what is served (``ExactnessLedger.may_serve``).

Samples: a range exploring times each count on its served forwards (the shadow side frozen
meanwhile, or none beside it) and on shadows, until the estimator chooses a count
(``estimator.choose``: ``update``; which counts it times: ``exploring.Exploring``); mode 2 with
a voucher serves the counts it lacks samples for in turn (vouched exploration), audited at the
configured count. Once learned, every ``audit_every``-th forward gets a probe shadow at another
count, and forwards at a count whose time moved by ``relearn_factor`` from that same count's
when learned relearn the range (``estimator.changed``: ``relearning.Relearning``, R4.11). A
shadow that differs from the served answer retires learning for good (``drift``, R4.7). A new
worker learns from fresh samples; drift and vouchers survive restarts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from vllm_srun.records.host_record import DriftEvent, Voucher
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.contention import FreeCores
from vllm_srun.tuner.estimator import choose, speedup, typical
from vllm_srun.tuner.exploring import Exploring
from vllm_srun.tuner.jobs import JobBoard
from vllm_srun.tuner.ledger import ExactnessLedger, first_difference
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.policy import shadow_plan
from vllm_srun.tuner.ranges import RangeLearning, learn, settle, sized
from vllm_srun.tuner.relearning import Relearning
from vllm_srun.tuner.samples import load_factor, served_cost_ms, served_sample_ms, size_exponent
from vllm_srun.tuner.scheduling import ShadowJob
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.tally import Tally

log = logging.getLogger(__name__)

class Learner(Exploring, Relearning):
    def __init__(self, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                 settings: TunerSettings, ledger: ExactnessLedger, sync: RecordSync,
                 free_cores: FreeCores, tally: Tally, worker: str) -> None:
        self.mode, self.configured, self.counts = mode, configured, tuple(counts)
        self.settings, self.ledger, self.sync = settings, ledger, sync
        self.free_cores = free_cores  # what other tasks leave: served times are scaled by it
        self.tally = tally  # it counts the served samples it took, or could not
        self.worker = worker  # named in the drift it records
        self.ranges: dict[int, RangeLearning] = {}
        self.board = JobBoard(settings, ledger, self.ranges, self.need)

    # -- the record read back, a served forward ended ----------------------------------------
    def read_back(self, event: DriftEvent | None, voucher: Voucher | None) -> None:
        """Drift and the voucher as the record holds them now: a drift any worker of the
        scope recorded retires this one; a new sweep or a reset starts or stops ranges
        serving at once."""
        if voucher is not None:
            self.ledger.voucher = voucher
        if event is not None and self.ledger.retired is None:
            self.retire(event)
            log.warning("threads_drift_seen_by_another worker=%s seen_by=%s rows=%d "
                        "padded_tokens=%d", self.worker, event.worker, event.rows,
                        event.padded_tokens)
        else:
            self.settle_all()

    def served(self, batch: TokenBatch, result: ForwardResult, contention: str | None,
               sample: bool, now: float, chosen: int = 0) -> bool:
        """A served forward ended while learning: a learned range watches its time
        (``watch_served``); an exploring one takes it as a ``sample`` where no shadow ran
        beside it. Either way its time is divided by the load factor of the cores other tasks
        left it (``samples.served_sample_ms``): the count's time with its cores free; none
        where half or more of it was other tasks'. An exploring range whose ``chosen`` count
        ran at fewer threads (the host's core ledger refused it) counts the refusal
        (``estimator.out_of_reach``). Returns whether the batch became its range's due
        shadow work."""
        lo = size_range(batch.padded_tokens)[0]
        r = self.ranges.setdefault(lo, RangeLearning())
        if r.exploring and result.num_threads < chosen:
            r.refused[chosen] = r.refused.get(chosen, 0) + 1
            if not sample:
                self.update(lo, r)  # out of reach now, it may leave the rule sure
        free = self.free_cores.at(now)
        factor = load_factor(result.num_threads, free)
        ms = served_sample_ms(result.forward_s * 1000, factor)
        if ms is None:  # the time was mostly other tasks'
            self.tally.samples_cores_held += sample and r.learned is None
        elif r.learned is not None:
            self.watch_served(lo, r, result.num_threads, ms, batch.padded_tokens, contention,
                              followed=free is not None)
        elif sample:
            self.tally.served_samples += 1
            self.tally.samples_scaled += factor > 1.0
            self.sample(lo, r, result.num_threads, ms, batch.padded_tokens)
            log.debug("threads_sample source=served range=%d num_threads=%d ms=%.3f rows=%d "
                      "padded_tokens=%d factor=%.3f", lo, result.num_threads, ms, batch.rows,
                      batch.padded_tokens, factor)
        counts = self.shadow_counts(lo, result.num_threads, contention, batch)
        if counts:
            self.put(lo, batch, result, counts, now)
        return bool(counts)

    def shadow_counts(self, lo: int, served: int, contention: str | None,
                      batch: TokenBatch) -> list[int]:
        """The counts to run as shadows of range ``lo``'s batch just served at ``served``
        (``policy.shadow_plan``, then mode 2's checks of what it served). A count the
        range's own served forwards of this shape time (``times_served``) is not timed by
        a shadow too."""
        r = self.ranges[lo]
        need = [n for n in self.need(r) if not self.times_served(r, n, batch)] \
            if r.exploring else []
        if r.learned is not None:
            r.served_at_learned += 1
        window_due = self.ledger.window_due(lo, r.learned)
        counts = shadow_plan(need, window_due, r.learned, served, self.counts,
                             r.served_at_learned, self.settings.learning.audit_every)
        if r.serving and contention is None and served == self.configured \
                and r.learned not in counts and r.learned != self.configured:
            counts = [r.learned, *counts]  # a shape no voucher covers yet: verify it
        if r.learned is None and served != self.configured:
            # served at another count while exploring: audit its answer at the configured
            # one; where served forwards are the samples, only that, while it fills the
            # count's window, then on every ``audit_every``-th forward explored on (as many
            # as a learned range's forwards get)
            if not r.explore_served:
                return [self.configured] + [n for n in counts if n != self.configured]
            audit = self.ledger.toward_window(lo, served, self.configured, None) or not \
                self.tally.explored % self.settings.learning.audit_every
            return [self.configured] if audit else []
        return counts

    def times_served(self, r: RangeLearning, n: int, batch: TokenBatch) -> bool:
        """Whether range ``r``'s own served forwards of ``batch``'s shape may time count
        ``n`` (mode 2, vouched exploration: ``explore_served``; the voucher covers the
        shape at ``n``), so that a shadow need not."""
        return r.explore_served and (n == self.configured or self.ledger.voucher.covers(
            batch.rows, int(batch.input_ids.shape[1]), n, self.configured))

    def put(self, lo: int, batch: TokenBatch, result: ForwardResult, counts: list[int],
            now: float) -> None:
        """Range ``lo``'s batch just served is its due shadow work now (the newest goes to
        the back); where some of it is payable, the range starts to starve from now."""
        job = ShadowJob(batch, result.outputs, result.num_threads, counts, result.forward_s)
        log.debug("threads_shadow_due range=%d served=%d counts=%s rows=%d padded_tokens=%d "
                  "explore_served=%s", lo, result.num_threads, counts, batch.rows,
                  batch.padded_tokens, self.ranges[lo].explore_served)
        self.board.put(lo, job)
        if any(self.board.payable(lo, job, n) for n in counts):
            self.board.starved_since.setdefault(lo, now)

    # -- a shadow ended --------------------------------------------------------------------
    def after_shadow(self, lo: int, job: ShadowJob, count: int, result: ForwardResult,
                     clean: bool, now: float, retry: bool = True, paid: bool = False,
                     overlapped_at: float | None = None) -> None:
        """A shadow ended at ``now``: the ledger compares it with the served answer (a
        difference is drift); a clean one is a sample (what it would cost a served forward:
        ``samples.served_cost_ms``), except of a count an exploring range's own served
        forwards time (``times_served``): the counts of a range are compared on samples of
        one kind, drawn from its traffic alike, so that shadow only verifies, and its batch
        does not run again for that count. The range's state moves on."""
        if not self.ledger.learning:
            return
        if (at := first_difference(job.outputs, result.outputs)) is not None:
            self.drift(job, count, result, at)
            return
        self.ledger.agree(lo, job.served_threads, count)
        self.sync.pending.comparisons += 1
        if job.served_threads != count and self.configured in (job.served_threads, count):
            other = count if job.served_threads == self.configured else job.served_threads
            self.sync.pending.shapes.add((*job.batch.input_ids.shape, other))  # this shape
        r = self.ranges.setdefault(lo, RangeLearning())
        progress = self.ledger.toward_window(lo, job.served_threads, count, r.learned)
        cost_ms = served_cost_ms(result.forward_s, result.waited_s, count)
        if clean and cost_ms is None:
            self.tally.preempted += 1  # compared bit for bit, but mostly waiting: no sample
        elif clean and not (r.exploring and self.times_served(r, count, job.batch)):
            progress |= r.exploring and count in self.need(r)
            self.sample(lo, r, count, cost_ms, job.batch.padded_tokens)
            log.debug("threads_sample source=%s range=%d num_threads=%d ms=%.3f rows=%d "
                      "padded_tokens=%d wall_ms=%.3f", "paid" if paid else "shadow", lo, count,
                      cost_ms, job.batch.rows, job.batch.padded_tokens, result.forward_s * 1000)
        r = self.ranges[lo]
        if count in job.counts:
            job.counts.remove(count)
        if retry and r.exploring and count in self.need(r) \
                and not self.times_served(r, count, job.batch):
            job.counts.append(count)  # still due: this batch (a shape load made) runs again
            # (if not ``retry``, after it waited for CPUs other tasks held: they likely
            # still do; the range's next served batch brings the count again), after a
            # backoff (``retry_backoff_max_s``) where a served forward overlapped it (one
            # that other tasks held up backs off by ``scheduling.SharingBackoff``)
            if overlapped_at is not None:
                job.retry_after(overlapped_at, self.settings.spending.retry_backoff_max_s)
        self.sync.pending.learned.add(lo)
        self.settle(lo, r)  # (a range that starts serving needs its backlog no more)
        self.board.ran(lo, job)
        if progress or paid:  # the share pays again only after ``starved_s`` more
            self.board.starve_again(lo, now)

    # -- the steps -------------------------------------------------------------------------
    def sample(self, lo: int, r: RangeLearning, count: int, ms: float, tokens: int) -> None:
        keep = self.settings.learning.max_samples
        for store, value in ((r.samples, ms), (r.tokens, tokens)):
            kept = store.setdefault(count, [])
            kept.append(value)
            del kept[:-keep]
        self.sync.pending.samples.setdefault((lo, count), []).append(ms)
        if r.exploring:
            self.update(lo, r)
        else:
            self.watch(lo, r, (count, "shadow"), self.at_lo(lo, r, ms, tokens),
                       self.settings.learning.probe_window)

    def update(self, lo: int, r: RangeLearning) -> None:
        """An exploring range took a sample: learn a count once the estimator chooses one
        (``estimator.choose``) by each count's time as a forward of the range's smallest
        size (``ranges.sized``): a range spans sizes up to 2x apart, and its forwards' times with
        them, which widened each count's interval so that a count 1.2x faster was learned
        from 12 samples in about half of the draws (sizes uniform over a range, 10-15%
        noise; per token, 77-95%, with fewer counts learned where none was faster:
        ``tests/test_estimator.py``)."""
        s = self.settings.learning
        new = choose(sized(r), self.explored(r), self.configured, s.min_samples, s.margin,
                     s.max_samples)
        if new is None:
            return
        if r.candidate is not None and new != r.candidate:  # its own timing rejects it
            log.info("threads_sibling_candidate_rejected range=%d-%d num_threads=%d", lo,
                     2 * lo - 1, r.candidate)
            r.rejected.add(r.candidate)
            r.candidate = None
            self.update(lo, r)  # explores every count now
            return
        learn(r, new, self.configured, self.mode is AdaptiveMode.SERVE,
              self.ledger.may_serve_range(lo, new))
        r.exponent = size_exponent(r.samples, r.tokens)
        r.baselines = {(n, "shadow"): typical(v) for n, v in sized(r).items()}
        r.recent = {}
        self.sync.pending.learned.add(lo)
        log.info("threads_learned range=%d-%d num_threads=%d speedup=%.3f", lo, 2 * lo - 1,
                 new, self.speedup(r))
        if r.serving:
            self.serving(lo, r)

    def settle(self, lo: int, r: RangeLearning) -> None:
        """Mode 2: the range starts serving its learned count once the ledger admits it (its
        window passed, vouched), and stops while it does not (the voucher withdrawn)."""
        if r.learned is not None and settle(r, self.ledger.may_serve_range(lo, r.learned)):
            self.serving(lo, r)

    def settle_all(self) -> None:
        """The voucher changed: each range starts or stops serving its learned count as the
        ledger now admits it."""
        for lo, r in self.ranges.items():
            self.settle(lo, r)

    def serving(self, lo: int, r: RangeLearning) -> None:
        self.board.backlog.pop(lo, None)
        log.info("threads_serving_learned range=%d-%d num_threads=%d verified_passes=%d",
                 lo, 2 * lo - 1, r.learned, self.ledger.progress(lo, r.learned))

    def speedup(self, r: RangeLearning) -> float:
        return speedup(sized(r), self.configured, r.learned or self.configured) or 1.0

    def drift(self, job: ShadowJob, count: int, result: ForwardResult,
              at: tuple[int, ...]) -> None:
        event = DriftEvent(job.batch.padded_tokens, job.served_threads, count, at,
                           float(job.outputs[at]), float(result.outputs[at]), time.time(),
                           job.batch.rows, self.worker)
        self.retire(event)
        log.warning("threads_drift worker=%s rows=%d padded_tokens=%d served_threads=%d "
                    "shadow_threads=%d first_index=%s served=%r shadow=%r", self.worker,
                    event.rows, event.padded_tokens, event.served_threads, count, list(at),
                    event.served_value, event.shadow_value)
        scope = self.sync.scope
        self.sync.guard("write_drift", lambda rec: rec.record_drift(scope, event))
        self.sync.guard("write_voucher", lambda rec: rec.add_voucher(scope, "traffic", 1, 1))

    def retire(self, event: DriftEvent) -> None:
        """Learning ends for good (R4.7): the ledger admits only the configured count."""
        self.ledger.retire(event)
        self.board.clear()
