"""Prometheus metrics of one front end (a registry per server, so tests can run several), and
``/metrics`` as one page: the front end's own families, then every worker's forward metrics
(labelled by ``replica``; in-process or not), each family once."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# seconds: a short input answers in a few ms, an 8k-token forward on the CPU takes tens of
# seconds, the default timeout_ms is 30 s and a deployment may set more
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "vllm_srun_request_duration_seconds",
            "HTTP request time in the front end, from its arrival to the end of its answer, by "
            "route (the path template; 'other' for unknown paths) and status class (2xx, 4xx, "
            "5xx). Overload refused at header time (429) is counted in "
            "vllm_srun_requests_total only", ["route", "status_class"],
            buckets=DURATION_BUCKETS, registry=self.registry)
        self.queue_seconds = Histogram(
            "vllm_srun_queue_wait_seconds",
            "Time an inference request waited in its worker's engine: from its submission to "
            "the engine (after tokenization and the result-cache lookup) until the first "
            "forward carrying one of its rows started; requests answered wholly from the "
            "cache, failed, or answered by an attached endpoint are not counted",
            ["deployment"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.input_tokens = Counter(
            "vllm_srun_input_tokens", "Prompt tokens of answered inference requests (the "
            "usage.prompt_tokens they report, special tokens included, cached rows too)",
            ["deployment"], registry=self.registry)
        self.requests = Counter("vllm_srun_requests", "HTTP inference requests by outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.exchanges = Counter("vllm_srun_replica_exchanges",
                                 "Requests dispatched to a replica, by outcome (success, "
                                 "timeout, deadline, failure, refused, cancelled, neutral, "
                                 "not_sent, overloaded)",
                                 ["deployment", "replica", "outcome"], registry=self.registry)
        self.ejections = Counter("vllm_srun_replica_ejections", "Outlier ejections",
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

    def request_done(self, route: str, status_class: str, total_s: float, trace) -> None:
        """One HTTP answer ended (``tracing.RequestTrace``); ``trace`` holds its phases."""
        self.request_seconds.labels(route, status_class).observe(total_s)
        if trace.deployment is not None:
            self.input_tokens.labels(trace.deployment).inc(trace.tokens)
            if trace.queue_s is not None:
                self.queue_seconds.labels(trace.deployment).observe(trace.queue_s)

    def exchange(self, deployment: str, replica: str, outcome: str) -> None:
        self.exchanges.labels(deployment, replica, outcome).inc()

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

    def render(self, worker_texts: Iterable[str] = ()) -> bytes:
        """This front end's families, then the workers' (merged per family)."""
        return generate_latest(self.registry) + merge_families(worker_texts)


class _Families(Collector):
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return self.families


def merge_families(texts: Iterable[str]) -> bytes:
    """Several workers' exposition texts as one, each metric family once (their samples
    differ by the ``replica`` label each worker sets)."""
    merged: dict = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    if not merged:
        return b""
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
