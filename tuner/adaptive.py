"""Adaptive threads (R4.3-R4.7): learn the fastest intra-op count per input-size range from
timed shadow passes that must reproduce the served answer bit for bit.

How it works: the engine asks ``served_threads`` before each forward and tells ``observe``
what it served. A served batch becomes a shadow job (the latest per size range) listing the
counts still to run on it: every allowed count while the range lacks samples (the configured
count included, so all counts are timed under the same idle conditions), the learned count
during mode 2's transition window, the configured count as an audit of forwards served at a
learned count. When the engine has nothing to serve, ``idle_work`` hands it one shadow forward
at a time, once traffic has paused for ``idle_gap_s``, while shadow time stays within
``budget_fraction`` of wall time. A shadow whose
output equals the served output bit for bit adds a timing sample; any difference is drift:
learning retires for good for this scope (stored durably) and every range serves the
configured count again at once.

Invariant: mode 1 serves every forward at the configured count; mode 2 serves a learned count
for a range only while the record vouches for the host, the count passed ``window``
consecutive verified shadows, and no drift was seen.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_srun.records.host_record import DriftEvent, HostRecord, HostRecordError, Scope, Voucher
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import counts_needing_samples, learned_count, moved

log = logging.getLogger(__name__)

Forward = Callable[[TokenBatch, int], ForwardResult]


@dataclass(frozen=True)
class TunerSettings:
    min_samples: int = 12  # timed shadows per count per range before a count is learned
    window: int = 8  # mode 2: consecutive verified shadows before a learned count serves
    margin: float = 0.05  # a non-configured count must be this much faster
    audit_every: int = 8  # mode 2: shadow every Nth forward served at a learned count
    budget_fraction: float = 0.5  # shadow time at most this share of wall time
    idle_gap_s: float = 0.005  # a shadow starts only after traffic paused this long
    relearn_factor: float = 2.0  # served time per token moved this much: explore again
    relearn_window: int = 32  # served forwards compared for relearning
    flush_s: float = 2.0  # how often learnings are written to the record
    max_samples: int = 48  # recent samples per count per range that decisions rest on


@dataclass
class RangeLearning:
    samples: dict[int, list[float]] = field(default_factory=dict)  # count -> forward ms
    learned: int | None = None
    streak: int = 0  # consecutive verified shadows at the learned count
    serving: bool = False
    relearning: bool = False
    served_at_learned: int = 0
    baseline_per_token: float | None = None
    recent_per_token: deque = field(default_factory=lambda: deque(maxlen=32))


@dataclass
class _Job:
    batch: TokenBatch
    outputs: np.ndarray
    served_threads: int
    counts: list[int]


def output_bits(outputs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(outputs, dtype=np.float32).view(np.uint32)


class AdaptiveThreads:
    """The adaptive ThreadsPolicy of one worker (see the module docstring)."""

    def __init__(self, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                 scope: Scope, record: HostRecord | None, forward: Forward,
                 settings: TunerSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode, self.configured, self.counts = mode, configured, tuple(counts)
        self.scope, self.record, self.forward = scope, record, forward
        self.settings = settings or TunerSettings()
        self.clock = clock
        self.locked_reason: str | None = "golden check has not run"
        self.record_error: str | None = None
        self.ranges: dict[int, RangeLearning] = {}
        self.comparisons = 0
        self.audits = 0  # verified shadows of forwards served at a learned count
        self._jobs: dict[int, _Job] = {}
        self._shadow_s = 0.0
        self._started = clock()
        self._last_flush = clock()
        self._last_served = clock()
        self._dirty_samples: dict[tuple[int, int], list[float]] = {}
        self._dirty_learned: set[int] = set()
        self._unflushed_comparisons = 0
        self.retired: DriftEvent | None = None
        self.voucher = Voucher(0, 0, False)
        self._load()

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
        record = self.record
        if record is None:
            return
        self.retired = self._guard("read_drift", lambda: record.drift(self.scope))
        self.voucher = self._guard("read_voucher", lambda: record.voucher(self.scope)) or \
            self.voucher
        timings = self._guard("read_timings", lambda: record.timings(self.scope)) or {}
        keep = self.settings.max_samples
        for lo, by_count in timings.items():
            self.ranges[lo] = RangeLearning(samples={n: list(v[-keep:])
                                                     for n, v in by_count.items()})
        learned = self._guard("read_learned", lambda: record.learned(self.scope)) or {}
        for lo, row in learned.items():  # a new process verifies its window again
            self.ranges.setdefault(lo, RangeLearning()).learned = row["num_threads"]
        for lo, r in self.ranges.items():  # samples may hold a decision never written
            self._update(lo, r)

    def flush(self) -> None:
        """Write pending samples, learned counts and traffic comparisons to the record."""
        record = self.record
        self._last_flush = self.clock()
        if record is None:
            return
        samples, self._dirty_samples = self._dirty_samples, {}
        learned, self._dirty_learned = self._dirty_learned, set()
        comparisons, self._unflushed_comparisons = self._unflushed_comparisons, 0

        def write() -> None:
            for (lo, n), ms in samples.items():
                record.add_samples(self.scope, lo, n, ms)
            for lo in learned:
                r = self.ranges[lo]
                if r.learned is not None:
                    record.put_learned(self.scope, lo, r.learned, self._speedup(r), r.streak)
            if comparisons:
                record.add_voucher(self.scope, "traffic", comparisons, 0)

        self._guard("flush", write)

    def close(self) -> None:
        self.flush()

    # -- start-up: warm pass and golden check (R4.3, R4.4) --------------------------------
    def startup(self, golden_rows: list[list[int]],
                reference: np.ndarray | None = None, tolerance: float = 1e-5) -> str | None:
        """Warm, then check the golden answers at the configured count; unlock exploration
        when they hold. Returns why the worker must stay out of dispatch, or None."""
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
        for n in self.counts:  # warm every count before it is timed
            if n != self.configured:
                self.forward(batches[0], n)
        self.locked_reason = None
        self._started = self.clock()
        log.info("threads_golden_passed mode=%d configured=%d counts=%s retired=%s",
                 self.mode, self.configured, list(self.counts), self.retired is not None)
        return None

    # -- ThreadsPolicy ---------------------------------------------------------------------
    def served_threads(self, batch: TokenBatch) -> int:
        r = self.ranges.get(size_range(batch.padded_tokens)[0])
        if r is not None and r.serving and self.retired is None and self.locked_reason is None:
            return r.learned
        return self.configured

    def observe(self, batch: TokenBatch, result: ForwardResult) -> None:
        self._last_served = self.clock()
        if self.locked_reason is not None or self.retired is not None:
            return
        lo = size_range(batch.padded_tokens)[0]
        r = self.ranges.setdefault(lo, RangeLearning())
        self._watch_for_relearning(lo, r, batch, result)
        counts = self._shadow_counts(r)
        if counts:
            self._jobs.pop(lo, None)  # the newest batch of a range goes to the back
            self._jobs[lo] = _Job(batch, result.outputs, result.num_threads, counts)

    def idle_work(self) -> Callable[[], None] | float | None:
        if self.locked_reason is not None or self.retired is not None:
            return None
        now = self.clock()
        quiet_s = now - self._last_served
        if self._jobs and quiet_s < self.settings.idle_gap_s:
            return self.settings.idle_gap_s - quiet_s  # traffic may go on: wait for a pause
        if self._jobs and self._shadow_s <= self.settings.budget_fraction * (now - self._started):
            lo = next(iter(self._jobs))
            job = self._jobs[lo]
            count = job.counts.pop(0)
            if not job.counts:
                del self._jobs[lo]
            return lambda: self._shadow(lo, job, count)
        if (self._dirty_samples or self._dirty_learned or self._unflushed_comparisons) and \
                now - self._last_flush >= self.settings.flush_s:
            return self.flush
        return None

    # -- learning ----------------------------------------------------------------------------
    def _shadow_counts(self, r: RangeLearning) -> list[int]:
        need = counts_needing_samples(r.samples, self.counts, self.settings.min_samples)
        if need:
            return need
        if self.mode is AdaptiveMode.SERVE and r.learned not in (None, self.configured) \
                and not r.serving:
            return [r.learned]  # transition window
        if r.serving:
            r.served_at_learned += 1
            if r.served_at_learned % self.settings.audit_every == 0:
                return [self.configured]  # audit a forward served at the learned count
        return []

    def _shadow(self, lo: int, job: _Job, count: int) -> None:
        if self.retired is not None:
            return
        result = self.forward(job.batch, count)
        self._shadow_s += result.forward_s
        if not np.array_equal(output_bits(result.outputs), output_bits(job.outputs)):
            self._drift(job, count, result)
            return
        self.comparisons += 1
        self._unflushed_comparisons += 1
        if job.served_threads != self.configured:
            self.audits += 1
        r = self.ranges.setdefault(lo, RangeLearning())
        ms = result.forward_s * 1000
        kept = r.samples.setdefault(count, [])
        kept.append(ms)
        del kept[: -self.settings.max_samples]
        self._dirty_samples.setdefault((lo, count), []).append(ms)
        self._update(lo, r)
        if count == r.learned and count != job.served_threads:
            r.streak += 1
            self._dirty_learned.add(lo)
        self._maybe_serve(lo, r)

    def _update(self, lo: int, r: RangeLearning) -> None:
        s = self.settings
        new = learned_count(r.samples, self.counts, self.configured, s.min_samples, s.margin)
        if new is None or new == r.learned:
            return
        r.learned, r.streak, r.serving, r.relearning = new, 0, False, False
        r.baseline_per_token = None
        r.recent_per_token.clear()
        self._dirty_learned.add(lo)
        log.info("threads_learned range=%d-%d num_threads=%d speedup=%.3f", lo, 2 * lo - 1,
                 new, self._speedup(r))

    def _maybe_serve(self, lo: int, r: RangeLearning) -> None:
        if (self.mode is AdaptiveMode.SERVE and not r.serving and self.retired is None
                and r.learned not in (None, self.configured)
                and r.streak >= self.settings.window and self.voucher.vouches):
            r.serving = True
            log.info("threads_serving_learned range=%d-%d num_threads=%d verified_passes=%d",
                     lo, 2 * lo - 1, r.learned, r.streak)

    def _speedup(self, r: RangeLearning) -> float:
        a, b = r.samples.get(self.configured), r.samples.get(r.learned or self.configured)
        return float(np.median(a) / np.median(b)) if a and b else 1.0

    def _drift(self, job: _Job, count: int, result: ForwardResult) -> None:
        at = tuple(int(i) for i in np.argwhere(
            output_bits(result.outputs) != output_bits(job.outputs))[0])
        event = DriftEvent(job.batch.padded_tokens, job.served_threads, count, at,
                           float(job.outputs[at]), float(result.outputs[at]), time.time())
        self.retired = event
        for r in self.ranges.values():
            r.serving = False
        self._jobs.clear()
        log.warning("threads_drift padded_tokens=%d served_threads=%d shadow_threads=%d "
                    "first_index=%s served=%r shadow=%r", event.padded_tokens,
                    event.served_threads, count, list(at), event.served_value,
                    event.shadow_value)
        record = self.record
        self._guard("write_drift", lambda: record.record_drift(self.scope, event))
        self._guard("write_voucher", lambda: record.add_voucher(self.scope, "traffic", 1, 1))
        self.flush()

    def _watch_for_relearning(self, lo: int, r: RangeLearning, batch: TokenBatch,
                              result: ForwardResult) -> None:
        """Served forwards much slower or faster than when learned: explore again."""
        if r.learned is None or result.num_threads != self.served_threads(batch):
            return
        s = self.settings
        r.recent_per_token.append(result.forward_s / batch.padded_tokens)
        if r.baseline_per_token is None:
            if len(r.recent_per_token) >= s.relearn_window // 2:
                r.baseline_per_token = float(np.median(r.recent_per_token))
                r.recent_per_token.clear()
            return
        if len(r.recent_per_token) < s.relearn_window // 2:
            return
        if moved(list(r.recent_per_token), r.baseline_per_token, s.relearn_factor):
            log.info("threads_relearn range=%d-%d reason=served_time_moved", lo, 2 * lo - 1)
            self.ranges[lo] = RangeLearning(relearning=True)
            self._dirty_samples = {k: v for k, v in self._dirty_samples.items() if k[0] != lo}
            self._guard("forget_range", lambda: self.record.forget_range(self.scope, lo))
        else:
            r.recent_per_token.clear()
