"""A worker's own metrics: forward time by input-size range and thread count, rows and
requests per forward, cache hits. Every sample carries the worker's ``replica`` label, so the
front end can serve the metrics of all its workers, in-process or not, in one ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from vllm_srun.runtime.sizes import range_label
from vllm_srun.runtime.types import ForwardRecord

_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class WorkerMetrics:
    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.registry = CollectorRegistry()
        self.forward_seconds = Histogram(
            "vllm_srun_forward_seconds", "Forward time by input-size range (padded tokens) "
            "and intra-op thread count", ["replica", "size_range", "num_threads"],
            buckets=_FORWARD_BUCKETS, registry=self.registry)
        self.batch_rows = Histogram("vllm_srun_batch_rows", "Rows per forward", ["replica"],
                                    buckets=_ROW_BUCKETS, registry=self.registry)
        self.batch_requests = Histogram("vllm_srun_batch_requests",
                                        "Requests sharing one forward", ["replica"],
                                        buckets=_ROW_BUCKETS, registry=self.registry)
        self.cache_hits = Gauge("vllm_srun_cache_hit_rows",
                                "Rows answered from the result cache since start", ["replica"],
                                registry=self.registry)

    def record_forward(self, rec: ForwardRecord) -> None:
        self.forward_seconds.labels(self.replica, range_label(rec.padded_tokens),
                                    str(rec.num_threads)).observe(rec.forward_s)
        self.batch_rows.labels(self.replica).observe(rec.rows)
        self.batch_requests.labels(self.replica).observe(rec.requests)

    def render(self, cache_hits: int) -> bytes:
        self.cache_hits.labels(self.replica).set(cache_hits)
        return generate_latest(self.registry)
