"""A worker's own metrics: forward time by input-size range and thread count, rows and
requests per forward, cache hits, and what adaptive threads learned (from the worker's threads
report, so ``/metrics`` and ``GET /v1/threads`` agree). Every sample carries the worker's
``replica`` label, so the front end can serve the metrics of all its workers, in-process or
not, in one ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from vllm_srun.runtime.sizes import range_label
from vllm_srun.runtime.types import ForwardRecord
from vllm_srun.tuner.advice import LearningState
from vllm_srun.tuner.policy import RangeState

# seconds: up to the longest forwards (an 8k-token input takes tens of seconds on the CPU)
_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class WorkerMetrics:
    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.registry = r = CollectorRegistry()
        self.forward_seconds = Histogram(
            "vllm_srun_forward_seconds", "Forward time by input-size range (padded tokens) "
            "and intra-op thread count", ["replica", "size_range", "num_threads"],
            buckets=_FORWARD_BUCKETS, registry=r)
        self.batch_rows = Histogram("vllm_srun_batch_rows", "Rows per forward", ["replica"],
                                    buckets=_ROW_BUCKETS, registry=r)
        self.batch_requests = Histogram("vllm_srun_batch_requests",
                                        "Requests sharing one forward", ["replica"],
                                        buckets=_ROW_BUCKETS, registry=r)
        self.cache_hits = Gauge("vllm_srun_cache_hit_rows",
                                "Rows answered from the result cache since start", ["replica"],
                                registry=r)
        self.learning_state = Gauge(
            "vllm_srun_learning_state", "Adaptive threads: 1 for the worker's learning state "
            "(locked: off or golden check not passed; learning; serving: mode 2 serves a "
            "learned count somewhere; retired: by drift), 0 for the others",
            ["replica", "state"], registry=r)
        self.retired = Gauge("vllm_srun_learning_retired",
                             "1 when a drift retired learning for this worker's scope",
                             ["replica"], registry=r)
        self.vouched = Gauge("vllm_srun_learning_voucher",
                             "1 when the host record holds a voucher of bit-identity across "
                             "counts for this worker's scope", ["replica"], registry=r)
        self.paid = Gauge("vllm_srun_learning_paid_seconds",
                          "Seconds of shadow forwards learning ran at normal priority beside "
                          "served forwards (the paid learning share, --learning-share)",
                          ["replica"], registry=r)
        self.served = Gauge("vllm_srun_range_served_threads",
                            "Intra-op threads serving each input-size range now",
                            ["replica", "size_range"], registry=r)
        self.learned = Gauge("vllm_srun_range_learned_threads",
                             "The count learned for each input-size range (0: none yet)",
                             ["replica", "size_range"], registry=r)
        self.range_state = Gauge("vllm_srun_range_state",
                                 "1 for each input-size range's learning state, 0 for the others",
                                 ["replica", "size_range", "state"], registry=r)
        self.non_finite = Gauge(
            "vllm_srun_non_finite_answers", "Requests failed because the model answered NaN "
            "or infinity for one of their inputs (since start)", ["replica"], registry=r)
        self.core_limited = Gauge(
            "vllm_srun_shared_cores_limited_forwards", "Forwards served at a lower count "
            "than wanted because the CPU workers of the host together would have passed the "
            "CPU budget less what other tasks hold (since start)", ["replica"], registry=r)

    def record_forward(self, rec: ForwardRecord) -> None:
        self.forward_seconds.labels(self.replica, range_label(rec.padded_tokens),
                                    str(rec.num_threads)).observe(rec.forward_s)
        self.batch_rows.labels(self.replica).observe(rec.rows)
        self.batch_requests.labels(self.replica).observe(rec.requests)

    def record_learning(self, report: dict) -> None:
        """The gauges from a threads report (``tuner/report.py``)."""
        rid = self.replica
        for state in LearningState:
            self.learning_state.labels(rid, state.value).set(state.value == report["state"])
        self.retired.labels(rid).set(report["drift"] is not None)
        self.vouched.labels(rid).set(report["voucher"]["vouches"])
        self.paid.labels(rid).set(report["learning"].get("paid_shadow_seconds", 0.0))
        for gauge in (self.served, self.learned, self.range_state):
            gauge.clear()
        for rng in report["ranges"]:
            labels = (rid, rng["size_range"])
            self.served.labels(*labels).set(rng["served_threads"])
            self.learned.labels(*labels).set(rng["learned_threads"] or 0)
            for state in RangeState:
                self.range_state.labels(*labels, state.value).set(state.value == rng["state"])

    def render(self, cache_hits: int, threads_report: dict | None = None,
               core_limited: int | None = None, non_finite: int = 0) -> bytes:
        """``core_limited``: ``SharedCores.limited`` where the worker shares the host's
        cores, else None (no sample); ``non_finite``: ``Engine.non_finite``."""
        self.cache_hits.labels(self.replica).set(cache_hits)
        self.non_finite.labels(self.replica).set(non_finite)
        if core_limited is not None:
            self.core_limited.labels(self.replica).set(core_limited)
        if threads_report is not None:
            self.record_learning(threads_report)
        return generate_latest(self.registry)
