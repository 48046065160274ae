"""The simulator's vocabulary (``tuner/simulate.py``): what arrives, what else runs on the
host, its noise, and what a run shows."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_srun.records.host_record import Coverage, HostRecord, Scope
from vllm_srun.runtime.types import TokenBatch


@dataclass(frozen=True)
class Arrival:
    at_s: float
    padded_tokens: int  # the request's tokens (one row)


@dataclass(frozen=True)
class Neighbour:
    """``cores`` busy threads at normal priority over ``[start_s, end_s)``."""

    cores: float
    start_s: float
    end_s: float = math.inf


@dataclass(frozen=True)
class Noise:
    """Per-forward lognormal sigma, and the host-wide factor's (log) sigma and time constant.
    Assumed, not measured apart: FACTS.md reports the same timing varying about +-30%
    between runs on this shared host, which the host-wide factor's spread covers."""

    forward: float = 0.05
    host: float = 0.10
    host_tau_s: float = 30.0


@dataclass
class Outcome:
    """Per served forward, in the order they ended; per request, its latency."""

    served_ms: list[float] = field(default_factory=list)
    served_threads: list[int] = field(default_factory=list)
    at_s: list[float] = field(default_factory=list)  # when each forward started
    worker: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # each forward's padded length per row
    explored: list[bool] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)  # per request: queue plus forward
    max_served_threads: int = 0  # most served threads at once, all workers together
    over_cores_s: float = 0.0  # time the served threads of all workers passed the cores
    # (time, worker, new count): each time the count a worker serves for a size range
    # changed (mode 2's forwards served at a count only to time it aside)
    changes: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def mean_latency_ms(self) -> float:
        return float(np.mean(self.latency_ms))

    @property
    def served_s(self) -> float:
        return float(np.sum(self.served_ms)) / 1000


@dataclass
class InFlight:
    """A forward in flight on the simulated host (mutable: the event loop advances it)."""

    worker: int
    threads: int
    left_ms: float  # quiet-host work left
    start_s: float
    shadow: bool
    batch: TokenBatch
    requests: list[tuple[int, float]] = field(default_factory=list)  # (id, arrived at)
    waited_s: float = 0.0
    explored: bool = False  # mode 2 served it at a count only to time it (``explored``)


def batch_of(rows: int, length: int) -> TokenBatch:
    ids = np.ones((rows, length), dtype=np.int64)
    return TokenBatch(ids, ids)


def answer(batch: TokenBatch) -> np.ndarray:
    """The same at every count: a vouched, bit-exact host."""
    return np.full((batch.rows, 4), float(batch.input_ids.shape[1]), dtype=np.float32)




@dataclass
class SimWorker:
    """A simulated worker's serving side (mutable: the event loop moves it on)."""

    queue: deque[tuple[int, Arrival]] = field(default_factory=deque)  # (id, request) waiting
    serving: InFlight | None = None  # its served forward in flight
    # size range -> the count it served there last (forwards served to time a count
    # aside); a range not served yet: the configured (or fixed) count
    count_now: dict[int, int] = field(default_factory=dict)
    next_poll: float = math.inf  # when its shadow loop next wakes
    next_watch: float = math.inf  # when its record watch next reads the record


def vouched_record(directory: Path, scope: Scope, counts: Sequence[int]) -> HostRecord:
    """A real record in ``directory`` whose sweep vouches for every count and shape of
    ``scope`` (a modelled host)."""
    record = HostRecord(directory / "record.sqlite")
    big = 1 << 30
    record.add_voucher(scope, "verify", 1, 0, Coverage(tuple(counts), big, 1, big, big, big, 1))
    return record
