"""Each size range's learning (R4.5, R4.6, R4.11): its state (``ranges.RangeLearning``), its
due shadow work (``jobs.JobBoard``), and the steps that move them on a sample, a comparison
or a change (``Learner``). The tuner (``adaptive.AdaptiveThreads``) calls them with its lock
held; nothing here runs a forward or decides what is served (``ExactnessLedger.may_serve``).

Samples: an exploring range takes each count's time from served forwards and shadows until
the estimator chooses a count (``estimator.choose``: ``update``); a learned range's times are
watched against those it was learned with (``estimator.changed``: ``watch``), and a moved
one relearns the range. A shadow that differs from the served answer retires learning for
good (``drift``, R4.7).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from vllm_srun.records.host_record import DriftEvent
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.contention import ContentionWatch
from vllm_srun.tuner.estimator import (
    changed,
    choose,
    counts_needing_samples,
    served_cost_ms,
    typical,
)
from vllm_srun.tuner.jobs import JobBoard
from vllm_srun.tuner.ledger import ExactnessLedger, first_difference
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.policy import shadow_plan
from vllm_srun.tuner.ranges import Phase, RangeLearning, learn, relearn, settle
from vllm_srun.tuner.scheduling import ShadowJob
from vllm_srun.tuner.settings import TunerSettings

log = logging.getLogger(__name__)


class Learner:
    def __init__(self, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                 settings: TunerSettings, ledger: ExactnessLedger, sync: RecordSync,
                 contention: ContentionWatch, worker: str) -> None:
        self.mode, self.configured, self.counts = mode, configured, tuple(counts)
        self.settings, self.ledger, self.sync, self.contention = settings, ledger, sync, contention
        self.worker = worker  # named in the drift it records
        self.ranges: dict[int, RangeLearning] = {}
        self.board = JobBoard(settings.window, self.toward_window)

    # -- what a range needs ----------------------------------------------------------------
    def need(self, r: RangeLearning) -> list[int]:
        """Counts an exploring range still lacks ``min_samples`` of."""
        return counts_needing_samples(r.samples, self.counts, self.settings.min_samples)

    def toward_window(self, lo: int, job: ShadowJob) -> bool:
        """``job``'s one comparison would count toward a transition window still open
        (``ExactnessLedger.toward_window``)."""
        r = self.ranges.get(lo)
        return len(job.counts) == 1 and r is not None and self.ledger.toward_window(
            lo, job.served_threads, job.counts[0], r.learned)

    def payable(self, lo: int, job: ShadowJob, count: int) -> bool:
        """A shadow the learning share may pay for: it times a count its exploring range
        lacks samples of, or compares toward a transition window still open (R4.5 amended;
        not audits of what a range serves, nor probes)."""
        r = self.ranges.get(lo)
        return r is not None and ((r.exploring and count in self.need(r)) or
                                  self.ledger.toward_window(lo, job.served_threads, count,
                                                            r.learned))

    def expected_s(self, lo: int, job: ShadowJob, count: int) -> float:
        """How long a shadow of ``job`` at ``count`` will likely take: the count's samples in
        its range, else the served forward's time scaled by the counts' ratio."""
        r = self.ranges.get(lo)
        known = r.samples.get(count) if r is not None else None
        return typical(known) / 1000 if known else job.served_s * job.served_threads / count

    def starved(self, lo: int, now: float) -> bool:
        """Range ``lo``'s payable work made no progress for ``starved_s``."""
        since = self.board.starved_since.get(lo)
        return since is not None and now - since >= self.settings.starved_s

    def paid_due(self, now: float, affords: Callable[[float], bool]
                 ) -> tuple[int, ShadowJob, int] | None:
        """The first due shadow, ranges oldest first, whose range starved (``starved``), that
        is payable (``payable``) and whose expected cost the share ``affords``."""
        for lo, job in self.board.jobs.items():
            if not self.starved(lo, now):
                continue
            for count in job.counts:
                if self.payable(lo, job, count) and affords(self.expected_s(lo, job, count)):
                    return lo, job, count
        return None

    def explore_count(self, r: RangeLearning, serving: int, need: list[int]) -> int:
        """The count with the fewest samples among those a range needs now (ties: the one
        nearest the count it serves); when it may time none now (other tasks hold their
        cores), the vouched count fastest so far (``serving`` before any has a few
        samples)."""
        if not need:
            known = [n for n in self.counts if len(r.samples.get(n, ())) >= 3
                     and self.ledger.voucher.covers_counts(n, self.configured)]
            return min(known, key=lambda n: (typical(r.samples[n]), n != serving, n)) \
                if known else serving
        return min(need, key=lambda n: (len(r.samples.get(n, ())),
                                        abs(n.bit_length() - serving.bit_length()), n))

    # -- a served forward ended --------------------------------------------------------------
    def watch_served(self, lo: int, r: RangeLearning, result: ForwardResult, tokens: int,
                     contention: str | None) -> None:
        """A learned range served a forward: its slowdown for the contention watch, and its
        time for the change detector (``watch``)."""
        per_token = result.forward_s * 1000 / tokens
        if (base := r.baselines.get((result.num_threads, "shadow"))) is not None:
            self.contention.note_slowdown(result.num_threads, per_token / base,
                                          contention == "probe")
        if contention is None and r.phase is not Phase.VERIFYING and not (
                r.serving and result.num_threads == r.learned > min(self.counts)):
            # a served count that contention can fall back from relearns by
            # ``contention_relearn_s`` instead (a brief neighbour: no relearning); a range in
            # its transition window is not relearned on the count it serves meanwhile (a
            # neighbour that comes and goes restarted it, again and again, before it could
            # pass)
            self.watch(lo, r, (result.num_threads, "served"), per_token,
                       self.settings.relearn_window)

    def shadow_counts(self, lo: int, served: int, contention: str | None) -> list[int]:
        """The counts to run as shadows of range ``lo``'s batch just served at ``served``
        (``policy.shadow_plan``, then mode 2's checks of what it served)."""
        r = self.ranges[lo]
        need = self.need(r) if r.exploring else []
        if r.learned is not None:
            r.served_at_learned += 1
        window_due = self.ledger.window_due(lo, r.learned)
        counts = shadow_plan(need, window_due, r.learned, served, self.counts,
                             r.served_at_learned, self.settings.audit_every)
        if r.serving and contention is None and served == self.configured \
                and r.learned not in counts and r.learned != self.configured:
            counts = [r.learned, *counts]  # a shape no voucher covers yet: verify it
        if r.learned is None and served != self.configured:
            # served at another count while exploring: audit its answer at the configured
            # one (only that, where served forwards are the samples)
            counts = [self.configured] + ([] if r.explore_served else [
                n for n in counts if n != self.configured])
        return counts

    def put(self, lo: int, batch: TokenBatch, result: ForwardResult, counts: list[int],
            now: float) -> None:
        """Range ``lo``'s batch just served is its due shadow work now (the newest goes to
        the back); where some of it is payable, the range starts to starve from now."""
        job = ShadowJob(batch, result.outputs, result.num_threads, counts, result.forward_s)
        self.board.put(lo, job)
        if any(self.payable(lo, job, n) for n in counts):
            self.board.starved_since.setdefault(lo, now)

    # -- a shadow ended --------------------------------------------------------------------
    def after_shadow(self, lo: int, job: ShadowJob, count: int, result: ForwardResult,
                     clean: bool, retry: bool = True, paid: bool = False) -> None:
        """A shadow ended: the ledger compares it with the served answer (a difference is
        drift); a clean one is a sample (what it would cost a served forward:
        ``estimator.served_cost_ms``); the range's state moves on."""
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
        if clean:
            progress |= r.exploring and count in self.need(r)
            self.sample(lo, r, count, served_cost_ms(result.forward_s, result.waited_s, count),
                        job.batch.padded_tokens)
        if progress or paid:  # the share pays again only after ``starved_s`` more
            self.board.starved_since.pop(lo, None)
        r = self.ranges[lo]
        if count in job.counts:
            job.counts.remove(count)
        if retry and r.exploring and count in self.need(r):
            job.counts.append(count)  # still due: this batch (a shape load made) runs again
            # (if not ``retry``, after it waited for CPUs other tasks held: they likely
            # still do; the range's next served batch brings the count again)
        self.sync.pending.learned.add(lo)
        self.settle(lo, r)  # (a range that starts serving needs its backlog no more)
        self.board.ran(lo, job)

    # -- the steps -------------------------------------------------------------------------
    def sample(self, lo: int, r: RangeLearning, count: int, ms: float, tokens: int) -> None:
        keep = self.settings.max_samples
        for store, value in ((r.samples, ms), (r.per_token, ms / tokens)):
            kept = store.setdefault(count, [])
            kept.append(value)
            del kept[:-keep]
        self.sync.pending.samples.setdefault((lo, count), []).append(ms)
        if r.exploring:
            self.update(lo, r)
        else:
            self.watch(lo, r, (count, "shadow"), ms / tokens, self.settings.probe_window)

    def update(self, lo: int, r: RangeLearning) -> None:
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
        a, b = r.samples.get(self.configured), r.samples.get(r.learned or self.configured)
        return typical(a) / typical(b) if a and b else 1.0

    def watch(self, lo: int, r: RangeLearning, key: tuple[int, str], per_token_ms: float,
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
            self.relearn(lo, r, r.learned if r.serving and key[1] == "shadow" else None)

    def relearn(self, lo: int, r: RangeLearning, keep_serving: int | None) -> None:
        self.ranges[lo] = relearn(r, keep_serving)
        self.contention.forget(lo)
        self.board.forget(lo)

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
