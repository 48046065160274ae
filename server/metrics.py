"""Prometheus metrics of one server (a registry per server, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_srun.runtime.sizes import range_label
from vllm_srun.runtime.types import ForwardRecord

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
        self.exchanges = Counter("vllm_srun_replica_exchanges",
                                 "Requests dispatched to a replica, by outcome (success, "
                                 "timeout, deadline, failure, refused, cancelled, neutral, "
                                 "not_sent, overloaded)",
                                 ["deployment", "replica", "outcome"], registry=self.registry)
        self.ejections = Counter("vllm_srun_replica_ejections", "Outlier ejections (R5.6)",
                                 ["deployment", "replica"], registry=self.registry)
        self.readmissions = Counter("vllm_srun_replica_readmissions",
                                    "Readmissions after ejection (cool-down or success)",
                                    ["deployment", "replica"], registry=self.registry)
        self.withheld = Counter("vllm_srun_replica_ejections_withheld",
                                "Ejections a rule held back", ["deployment", "replica"],
                                registry=self.registry)
        self.restarts = Gauge("vllm_srun_replica_restarts", "Managed worker restarts so far",
                              ["deployment", "replica"], registry=self.registry)
        self.replica_in_flight = Gauge("vllm_srun_replica_in_flight", "Requests in flight",
                                       ["deployment", "replica"], registry=self.registry)
        self.replica_bytes = Gauge("vllm_srun_replica_outstanding_bytes",
                                   "Outstanding request bytes (the dispatch estimate)",
                                   ["deployment", "replica"], registry=self.registry)
        self.replica_state = Gauge("vllm_srun_replica_state", "1 for the replica's state",
                                   ["deployment", "replica", "state"], registry=self.registry)
        self.ready = Gauge("vllm_srun_ready", "1 when the model is loaded and warm",
                           registry=self.registry)

    def record_forward(self, rec: ForwardRecord) -> None:
        self.forward_seconds.labels(range_label(rec.padded_tokens),
                                    str(rec.num_threads)).observe(rec.forward_s)
        self.batch_rows.observe(rec.rows)
        self.batch_requests.observe(rec.requests)

    def pool_event(self, kind: str, deployment: str, replica: str) -> None:
        counter = {"replica_ejected": self.ejections, "replica_readmitted": self.readmissions,
                   "replica_ejection_withheld": self.withheld}.get(kind)
        if counter is not None:
            counter.labels(deployment, replica).inc()

    def pool_snapshot(self, inventory: dict) -> None:
        self.replica_state.clear()
        for dep in inventory["deployments"]:
            for r in dep["replicas"]:
                labels = (dep["name"], r["id"])
                self.replica_in_flight.labels(*labels).set(r["in_flight"])
                self.replica_bytes.labels(*labels).set(r["outstanding_bytes"])
                self.replica_state.labels(*labels, r["state"]).set(1)
                self.restarts.labels(*labels).set(r["restarts"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
