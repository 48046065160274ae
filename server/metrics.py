"""Prometheus metrics of one server (a registry per server, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.sizes import range_label
from runtime.types import ForwardRecord

_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vllm_srun_requests", "HTTP inference requests by outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.forward_seconds = Histogram(
            "vllm_srun_forward_seconds", "Forward time by input-size range (padded tokens) "
            "and intra-op thread count", ["size_range", "num_threads"],
            buckets=_FORWARD_BUCKETS, registry=self.registry)
        self.batch_rows = Histogram("vllm_srun_batch_rows", "Rows per forward",
                                    buckets=_ROW_BUCKETS, registry=self.registry)
        self.batch_requests = Histogram("vllm_srun_batch_requests",
                                        "Requests sharing one forward",
                                        buckets=_ROW_BUCKETS, registry=self.registry)
        self.cache_hits = Gauge("vllm_srun_cache_hit_rows",
                                "Rows answered from the result cache since start",
                                registry=self.registry)
        self.ready = Gauge("vllm_srun_ready", "1 when the model is loaded and warm",
                           registry=self.registry)

    def record_forward(self, rec: ForwardRecord) -> None:
        self.forward_seconds.labels(range_label(rec.padded_tokens),
                                    str(rec.num_threads)).observe(rec.forward_s)
        self.batch_rows.observe(rec.rows)
        self.batch_requests.observe(rec.requests)

    def render(self) -> bytes:
        return generate_latest(self.registry)
