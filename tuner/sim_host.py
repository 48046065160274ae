"""A simulated host: several workers, each with the real ``AdaptiveThreads`` (or a fixed count),
sharing ``cores`` with each other, their shadows and a neighbour, on a virtual clock.

How it works: an event loop holds every forward in flight (served and shadow) with the work it
has left, in quiet-host milliseconds (``ConfigFit.quiet_ms`` times a per-forward lognormal
noise). Between events every forward progresses at the rate ``cores_share`` gives it for the
threads that want the cores now, divided by a host-wide slowness factor (a log-Ornstein-Uhlenbeck
process: the correlated part of the noise). Events: an arrival (dispatched to the worker with
the fewest requests waiting), a forward's end, a neighbour's change, a shadow loop's poll.

Each worker's shadow loop is a thread of its own that runs only while the event loop waits for
it (one thread runs at a time, so runs are deterministic): it calls ``tuner.step()`` until it
returns False; a shadow forward (``shadow_forward``) registers its forward with the event loop
and blocks until the virtual clock reaches its end. The tuner is driven through its public
API only: ``startup``, ``served_threads``, ``observe``, ``step``, ``pending_shadows``,
``close``, the ``explored`` counter, and the callbacks it is constructed with (``clock``,
``shadow_forward``, ``pause_shadows``, ``free_cpu_s``); a real host record (a sweep's
voucher covering every count and shape) is its record.

Invariant: the virtual clock only moves in the event loop, while every shadow thread waits.
"""

from __future__ import annotations

import math
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from vllm_srun.records.host_record import Coverage, HostRecord, Scope
from vllm_srun.runtime.batching import PendingRow, next_batch
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode, allowed_counts
from vllm_srun.tuner.sim_calibration import TimeModel
from vllm_srun.tuner.sim_lane import ShadowLane
from vllm_srun.tuner.sim_model import cores_share
from vllm_srun.tuner.sim_types import (
    Arrival,
    InFlight,
    Neighbour,
    Noise,
    Outcome,
    answer,
    batch_of,
)

__all__ = ["Arrival", "CoresHook", "Neighbour", "Noise", "Outcome", "SimulatedHost"]

POLL_S = 0.05  # the real shadow loop's wait while shadows are due (tuner/shadow_loop.py)
# a hook for host-wide core sharing (tuner/cores.py): (worker, count its tuner wants, the
# counts the other workers serve now) -> the count it runs
CoresHook = Callable[[int, int, Sequence[int]], int]


class SimulatedHost:
    """``workers`` workers on ``model.cores`` cores running ``model.fit()`` (one backend x
    precision). ``fixed``: every forward at that count; else the real tuner in ``mode`` in
    each, configured ``configured`` (default R2.3's), allowed ``counts`` (default
    ``allowed_counts``), vouched for every count and shape. Queued requests share a forward
    as the runtime batches them, up to ``max_rows`` rows (default 1: a forward per request)
    and ``max_tokens`` padded tokens."""

    def __init__(self, model: TimeModel, neighbours: Sequence[Neighbour] = (),
                 fixed: int | None = None, mode: AdaptiveMode = AdaptiveMode.SERVE,
                 settings: TunerSettings | None = None, seed: int = 0,
                 configured: int | None = None, free_cpus: bool = True, *,
                 counts: Sequence[int] | None = None, workers: int = 1, noise: Noise = Noise(),
                 cores_hook: CoresHook | None = None, max_rows: int = 1,
                 max_tokens: int = 2048) -> None:
        self.model, self.cores, self.fixed = model.fit(), model.cores, fixed
        configured = configured or max(1, min(16, model.cores // 2))  # default: R2.3
        counts = tuple(counts or allowed_counts(configured, model.cores))
        self.configured, self.counts = configured, counts
        self.neighbours, self.noise, self.hook = tuple(neighbours), noise, cores_hook
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.now_s = 0.0
        self._rng = np.random.default_rng(seed)
        self._log_host = 0.0  # the host-wide factor, log
        self._forwards: list[InFlight] = []
        self._queues: list[deque[tuple[int, Arrival]]] = [deque() for _ in range(workers)]
        self._serving: list[InFlight | None] = [None] * workers
        # per worker, size range -> the count it served there last (forwards served to time
        # a count aside); a range not served yet: the configured (or fixed) count
        self._count_now: list[dict[int, int]] = [{} for _ in range(workers)]
        self._first_count = fixed or configured
        self._free_s = [0.0] * workers  # CPU seconds other tasks left each worker so far
        self._next_poll = [math.inf] * workers
        self.out = Outcome()
        self._tmp = tempfile.TemporaryDirectory(prefix="sim-record-")
        self.tuners: list[AdaptiveThreads] = []
        self.lanes: list[ShadowLane] = []
        self._record: HostRecord | None = None
        if fixed is None:
            self._record = self._vouched_record(counts)
            for w in range(workers):
                self._add_tuner(w, mode, configured, counts, self._record, settings,
                                free_cpus)

    # -- set-up ------------------------------------------------------------------------------
    def _vouched_record(self, counts: Sequence[int]) -> HostRecord:
        """A real record whose sweep vouches for every count and shape (a modelled host)."""
        record = HostRecord(Path(self._tmp.name) / "record.sqlite")
        big = 1 << 30
        record.add_voucher(self.scope, "verify", 1, 0,
                           Coverage(tuple(counts), big, 1, big, big, big, 1))
        return record

    scope = Scope("sim", "sim", "sim")

    def _add_tuner(self, w: int, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                   record: HostRecord, settings: TunerSettings | None, free_cpus: bool) -> None:
        holder: list[ShadowLane] = []
        tuner = AdaptiveThreads(
            mode, configured, counts, self.scope, record, self._instant,
            settings or TunerSettings(background=False), clock=lambda: self.now_s,
            shadow_forward=lambda b, n: holder[0].shadow_forward(b, n),
            worker=f"sim {w}", pause_shadows=lambda f: holder[0].pause(f),
            free_cpu_s=(lambda: (self.now_s, self._free_s[w])) if free_cpus else None)
        holder.append(ShadowLane(self, w, tuner))
        if (why := tuner.startup([[101, 2000, 102], [101, 2001, 2002, 102]])) is not None:
            raise RuntimeError(f"simulated worker {w}: {why}")
        self.tuners.append(tuner)
        self.lanes.append(holder[0])

    @staticmethod
    def _instant(batch: TokenBatch, n: int) -> ForwardResult:
        """The engine's own forward (golden check, warm-up): instant, not timed."""
        return ForwardResult(answer(batch), n, n, 0.0)

    @property
    def tuner(self) -> AdaptiveThreads | None:
        return self.tuners[0] if self.tuners else None

    # -- forwards ---------------------------------------------------------------------------
    def start_forward(self, w: int, batch: TokenBatch, n: int, shadow: bool) -> InFlight:
        ms = self.model.quiet_ms(batch.rows, int(batch.input_ids.shape[1]), n)
        ms *= float(np.exp(self._rng.normal(0, self.noise.forward)))
        fwd = InFlight(w, n, ms, self.now_s, shadow, batch)
        self._forwards.append(fwd)
        return fwd

    def neighbour_threads(self, at_s: float) -> float:
        return sum(n.cores for n in self.neighbours if n.start_s <= at_s < n.end_s)

    def _rates(self) -> tuple[list[float], float, float]:
        served = sum(f.threads for f in self._forwards if not f.shadow)
        neighbour = self.neighbour_threads(self.now_s)
        shadows = sum(f.threads for f in self._forwards
                      if f.shadow and not self.lanes[f.worker].frozen)
        share = cores_share(self.cores, served + neighbour, shadows)
        slow = math.exp(self._log_host)
        rates = [0.0 if f.shadow and self.lanes[f.worker].frozen else
                 (share.shadow if f.shadow else share.served) / slow for f in self._forwards]
        return rates, share.shadow, min(1.0, self.cores / max(served + neighbour, 1e-9))

    def _advance(self, to_s: float, rates: list[float], q_shadow: float, q: float) -> None:
        dt = to_s - self.now_s
        if dt <= 0:
            return
        neighbour = self.neighbour_threads(self.now_s) * q
        per_worker = [0.0] * len(self._queues)
        for f, r in zip(self._forwards, rates, strict=True):
            f.left_ms -= r * dt * 1000
            if f.shadow and r > 0:
                f.waited_s += f.threads * (1 - q_shadow) * dt
            elif not f.shadow:
                per_worker[f.worker] += f.threads * q
        total = sum(per_worker)
        if sum(f.threads for f in self._forwards if not f.shadow) > self.cores:
            self.out.over_cores_s += dt
        for w in range(len(self._queues)):
            self._free_s[w] += dt * max(0.0, self.cores - neighbour - (total - per_worker[w]))
        decay = math.exp(-dt / self.noise.host_tau_s)
        self._log_host = self._log_host * decay + self.noise.host * math.sqrt(
            1 - decay * decay) * float(self._rng.normal())
        self.now_s = to_s

    # -- the event loop ---------------------------------------------------------------------
    def run(self, trace: Sequence[Arrival]) -> Outcome:
        """Serve ``trace`` to the end (every request answered); the host closes after."""
        arrivals = deque(sorted(trace, key=lambda a: a.at_s))
        edges = sorted({t for n in self.neighbours for t in (n.start_s, n.end_s)
                        if math.isfinite(t)})
        ids = 0
        try:
            while True:
                self._start_idle_workers()
                self._poll_lanes()
                rates, q_shadow, q = self._rates()
                ends = [self.now_s + f.left_ms / (r * 1000) if r > 0 else math.inf
                        for f, r in zip(self._forwards, rates, strict=True)]
                nxt = min([*ends, *(t for t in edges if t > self.now_s),
                           arrivals[0].at_s if arrivals else math.inf,
                           *(self._next_poll[w] for w, lane in enumerate(self.lanes)
                             if lane.in_flight is None)], default=math.inf)
                if not arrivals and not any(self._queues) and \
                        all(s is None for s in self._serving):
                    return self.out
                if math.isinf(nxt):
                    raise RuntimeError("simulation stalled: nothing left to happen")
                self._advance(max(nxt, self.now_s), rates, q_shadow, q)
                for f, end in zip(list(self._forwards), ends, strict=True):
                    if end <= nxt:
                        self._end(f)
                while arrivals and arrivals[0].at_s <= self.now_s:
                    self._dispatch(ids, arrivals.popleft())
                    ids += 1
        finally:
            self.close()

    def _dispatch(self, request: int, a: Arrival) -> None:
        """To the worker with the fewest requests waiting or in service."""
        load = [len(q) + (s is not None) for q, s in zip(self._queues, self._serving,
                                                          strict=True)]
        low = min(load)
        choices = [w for w, x in enumerate(load) if x == low]
        w = choices[int(self._rng.integers(len(choices)))]
        self._queues[w].append((request, a))

    def _start_idle_workers(self) -> None:
        for w, queue in enumerate(self._queues):
            if self._serving[w] is None and queue:
                self._start_served(w)

    def _start_served(self, w: int) -> None:
        queue = self._queues[w]
        pending = [PendingRow(rid, 0, a.padded_tokens) for rid, a in queue]
        chosen = {r.request_id for r in next_batch(pending, self.max_rows, self.max_tokens)}
        taken = [(rid, a) for rid, a in queue if rid in chosen]
        self._queues[w] = deque((rid, a) for rid, a in queue if rid not in chosen)
        batch = batch_of(len(taken), max(a.padded_tokens for _, a in taken))
        tuner = self.tuners[w] if self.tuners else None
        before = tuner.tally.explored if tuner is not None else 0
        n = self.fixed if tuner is None else tuner.served_threads(batch)
        explored = tuner is not None and tuner.tally.explored > before
        if self.hook is not None:
            n = self.hook(w, n, [f.threads for f in self._serving if f is not None])
        fwd = self.start_forward(w, batch, n, shadow=False)
        fwd.requests, fwd.explored = [(rid, a.at_s) for rid, a in taken], explored
        self._serving[w] = fwd
        lo = size_range(batch.padded_tokens)[0]
        if n != self._count_now[w].get(lo, self._first_count) and not explored:
            self.out.changes.append((self.now_s, w, n))
        if not explored:
            self._count_now[w][lo] = n
        self.out.max_served_threads = max(self.out.max_served_threads, sum(
            f.threads for f in self._serving if f is not None))

    def _end(self, f: InFlight) -> None:
        self._forwards.remove(f)
        w = f.worker
        if f.shadow:
            self.lanes[w].resume()
            self._schedule_poll(w)
            return
        wall_s = self.now_s - f.start_s
        self._serving[w] = None
        if self.tuners:
            self.tuners[w].observe(f.batch, ForwardResult(answer(f.batch), f.threads,
                                                          f.threads, wall_s))
        out = self.out
        out.served_ms.append(wall_s * 1000)
        out.served_threads.append(f.threads)
        out.at_s.append(f.start_s)
        out.worker.append(w)
        out.rows.append(f.batch.rows)
        out.explored.append(f.explored)
        out.latency_ms.extend((self.now_s - at) * 1000 for _, at in f.requests)
        if self.lanes and not self._queues[w]:
            self._next_poll[w] = self.now_s  # a served forward's end wakes the shadow loop

    def _schedule_poll(self, w: int) -> None:
        lane = self.lanes[w]
        self._next_poll[w] = math.inf if lane.in_flight is not None or \
            not self.tuners[w].pending_shadows() else self.now_s + POLL_S

    def _poll_lanes(self) -> None:
        for w, lane in enumerate(self.lanes):
            if self._next_poll[w] <= self.now_s and lane.in_flight is None:
                lane.wake()
                self._schedule_poll(w)

    def close(self) -> None:
        for lane in self.lanes:
            lane.stop()
        for tuner in self.tuners:
            tuner.close()
        self.lanes, self._forwards = [], [f for f in self._forwards if not f.shadow]
        if self._record is not None:
            self._record.close()
        self._tmp.cleanup()
