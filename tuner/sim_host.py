"""A simulated host: several workers, each with the real ``AdaptiveThreads`` (or a fixed count),
sharing ``cores`` with each other, their shadows and a neighbour, on a virtual clock.

How it works: an event loop moves the host's cores on the virtual clock (``sim_clock.py``:
every forward in flight with the work it has left, and the rate each progresses at) from one
event to the next. Events: an arrival (dispatched to the worker with the fewest requests
waiting), a forward's end, a neighbour's change, a shadow loop's poll, a worker's record watch
(what it learned written to the shared record, its siblings' counts read back).

Each worker's shadow loop is a thread of its own that runs only while the event loop waits for
it (one thread runs at a time, so runs are deterministic): it calls ``tuner.step()`` until it
returns False; a shadow forward (``shadow_forward``) registers its forward with the event loop
and blocks until the virtual clock reaches its end. The tuner is driven through its public
API only: ``startup``, ``served_threads``, ``observe``, ``step``, ``pending_shadows``,
``place_held_until`` (no served forward starts on a worker whose place a paid shadow holds,
as the real engine waits), ``close``, ``flush_due``, ``flush``, ``poll_record``, the
``explored`` counter, and the callbacks it is constructed with (``clock``,
``shadow_forward``, ``pause_shadows``, ``free_cpu_s``); a real host record (a sweep's
voucher covering every count and shape), shared by all workers, is its record.

Invariant: the virtual clock only moves in the event loop, while every shadow thread waits.
"""

from __future__ import annotations

import math
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.batching import PendingRow, next_batch
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode, allowed_counts
from vllm_srun.tuner.sim_calibration import TimeModel
from vllm_srun.tuner.sim_clock import CoreClock
from vllm_srun.tuner.sim_lane import ShadowLane
from vllm_srun.tuner.sim_types import (
    Arrival,
    InFlight,
    Neighbour,
    Noise,
    Outcome,
    SimWorker,
    answer,
    batch_of,
    vouched_record,
)

__all__ = ["Arrival", "CoresHook", "Neighbour", "Noise", "Outcome", "SimulatedHost"]

POLL_S = 0.05  # the real shadow loop's wait while shadows are due (tuner/shadow_loop.py)
# a hook for host-wide core sharing (tuner/cores.py): (worker, count its tuner wants, the
# counts the other workers serve now, the counts below the wanted one its tuner may serve
# instead, the cores the neighbour held over the last reading's window or None) -> the
# count it runs
CoresHook = Callable[[int, int, Sequence[int], Sequence[int], "float | None"], int]
HELD_WINDOW_S = 0.1  # as ``FreeCpus.held`` reads: windows of at least this long


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
        self.cores, self.fixed = model.cores, fixed
        configured = configured or max(1, min(16, model.cores // 2))  # default: R2.3
        counts = tuple(counts or allowed_counts(configured, model.cores))
        self.configured, self.counts, self.hook = configured, counts, cores_hook
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.clock = CoreClock(model.fit(), model.cores, neighbours, noise,
                               np.random.default_rng(seed), workers,
                               pooled=cores_hook is not None)
        self._workers = [SimWorker() for _ in range(workers)]
        self._free_cpus = free_cpus
        self._held_mark: tuple[float, float] | None = None  # (when, neighbour core-s)
        self._held_now: float | None = None
        self.out = Outcome()
        self._tmp = tempfile.TemporaryDirectory(prefix="sim-record-")
        self.tuners: list[AdaptiveThreads] = []
        self.lanes: list[ShadowLane] = []
        self._record: HostRecord | None = None
        if fixed is None:
            self._record = vouched_record(Path(self._tmp.name), self.scope, counts)
            for w in range(workers):
                self._add_tuner(w, mode, configured, counts, self._record, settings,
                                free_cpus)
            for w, tuner in enumerate(self.tuners):  # the watches, staggered
                self._workers[w].next_watch = (w + 1) * tuner.settings.watch_s / workers

    # -- set-up ------------------------------------------------------------------------------
    scope = Scope("sim", "sim", "sim")

    def _add_tuner(self, w: int, mode: AdaptiveMode, configured: int, counts: Sequence[int],
                   record: HostRecord, settings: TunerSettings | None, free_cpus: bool) -> None:
        holder: list[ShadowLane] = []
        tuner = AdaptiveThreads(
            mode, configured, counts, self.scope, record, self._instant,
            (settings or TunerSettings()).with_(background=False, hold_place=True),
            clock=lambda: self.clock.now_s,
            shadow_forward=lambda b, n: holder[0].shadow_forward(b, n),
            worker=f"sim {w}", pause_shadows=lambda f: holder[0].pause(f),
            free_cpu_s=(lambda: (self.clock.now_s, self.clock.free_s[w])) if free_cpus
            else None)
        # the engine's ``behind``: more rows wait than one forward takes
        tuner.behind = lambda: len(self._workers[w].queue) >= self.max_rows
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

    # -- the event loop ---------------------------------------------------------------------
    def run(self, trace: Sequence[Arrival]) -> Outcome:
        """Serve ``trace`` to the end (every request answered); the host closes after."""
        arrivals = deque(sorted(trace, key=lambda a: a.at_s))
        clock = self.clock
        edges = sorted({t for n in clock.neighbours for t in (n.start_s, n.end_s)
                        if math.isfinite(t)})
        ids = 0
        try:
            while True:
                self._start_idle_workers()
                self._poll_lanes()
                rates, q_shadow, q = clock.rates(lambda w: self.lanes[w].frozen)
                ends = [clock.now_s + f.left_ms / (r * 1000) if r > 0 else math.inf
                        for f, r in zip(clock.forwards, rates, strict=True)]
                nxt = min([*ends, *(t for t in edges if t > clock.now_s),
                           arrivals[0].at_s if arrivals else math.inf,
                           *(self._workers[w].next_poll for w, lane in enumerate(self.lanes)
                             if lane.in_flight is None),
                           *(k.next_watch for k in self._workers),
                           *self._holds_lapse()], default=math.inf)
                if not arrivals and all(not k.queue and k.serving is None
                                        for k in self._workers):
                    return self.out
                if math.isinf(nxt):
                    raise RuntimeError("simulation stalled: nothing left to happen")
                self.out.over_cores_s += clock.advance(max(nxt, clock.now_s), rates, q_shadow,
                                                       q)
                for f, end in zip(list(clock.forwards), ends, strict=True):
                    if end <= nxt:
                        self._end(f)
                while arrivals and arrivals[0].at_s <= clock.now_s:
                    self._dispatch(ids, arrivals.popleft())
                    ids += 1
                self._watch_records()
        finally:
            self.close()

    def _holds_lapse(self) -> list[float]:
        """When the holds on workers with requests waiting lapse at the latest (a shadow's
        end, or its claim's release, comes first as its own event)."""
        now = self.clock.now_s
        return [t for w, k in enumerate(self._workers) if k.queue and self.tuners
                and (t := self.tuners[w].place_held_until()) > now]

    def _dispatch(self, request: int, a: Arrival) -> None:
        """To the worker with the fewest requests waiting or in service."""
        load = [len(k.queue) + (k.serving is not None) for k in self._workers]
        low = min(load)
        choices = [w for w, x in enumerate(load) if x == low]
        w = choices[int(self.clock.rng.integers(len(choices)))]
        self._workers[w].queue.append((request, a))

    def _start_idle_workers(self) -> None:
        for w, k in enumerate(self._workers):
            if k.serving is None and k.queue and not self._place_held(w):
                self._start_served(w)

    def _place_held(self, w: int) -> bool:
        """A paid shadow that times a count holds worker ``w``'s served forwards back (it
        runs, or waits for the one running to end), as the real engine's wait in
        ``served_threads`` does (``ShadowSteps.step``)."""
        return bool(self.tuners) and self.tuners[w].place_held_until() > self.clock.now_s

    def _held(self) -> float | None:
        """The cores the neighbour held over the last whole window of ``HELD_WINDOW_S``, as
        ``FreeCpus.held`` reads them (None before the first, or without free-CPU readings)."""
        if not self._free_cpus:
            return None
        now, mark = self.clock.now_s, self._held_mark
        if mark is None or now - mark[0] >= HELD_WINDOW_S:
            if mark is not None:
                self._held_now = (self.clock.held_s - mark[1]) / (now - mark[0])
            self._held_mark = (now, self.clock.held_s)
        return self._held_now

    def _serving_threads(self) -> list[int]:
        return [k.serving.threads for k in self._workers if k.serving is not None]

    def _start_served(self, w: int) -> None:
        k = self._workers[w]
        pending = [PendingRow(rid, 0, a.padded_tokens) for rid, a in k.queue]
        chosen = {r.request_id for r in next_batch(pending, self.max_rows, self.max_tokens)}
        taken = [(rid, a) for rid, a in k.queue if rid in chosen]
        k.queue = deque((rid, a) for rid, a in k.queue if rid not in chosen)
        batch = batch_of(len(taken), max(a.padded_tokens for _, a in taken))
        tuner = self.tuners[w] if self.tuners else None
        before = tuner.tally.explored if tuner is not None else 0
        n = self.fixed if tuner is None else tuner.served_threads(batch)
        explored = tuner is not None and tuner.tally.explored > before
        if self.hook is not None:
            lower = tuner.lower_counts(batch, n) if tuner is not None else ()
            n = self.hook(w, n, self._serving_threads(), lower, self._held())
        fwd = self.clock.start_forward(w, batch, n, shadow=False)
        fwd.requests, fwd.explored = [(rid, a.at_s) for rid, a in taken], explored
        k.serving = fwd
        lo = size_range(batch.padded_tokens)[0]
        if n != k.count_now.get(lo, self.fixed or self.configured) and not explored:
            self.out.changes.append((self.clock.now_s, w, n))
        if not explored:
            k.count_now[lo] = n
        self.out.max_served_threads = max(self.out.max_served_threads,
                                          sum(self._serving_threads()))

    def _end(self, f: InFlight) -> None:
        self.clock.forwards.remove(f)
        w, now_s = f.worker, self.clock.now_s
        if f.shadow:
            self.lanes[w].resume()
            self._schedule_poll(w)
            return
        wall_s = now_s - f.start_s
        self._workers[w].serving = None
        if self.tuners:
            self.tuners[w].observe(f.batch, ForwardResult(answer(f.batch), f.threads,
                                                          f.threads, wall_s))
        out = self.out
        out.served_ms.append(wall_s * 1000)
        out.served_threads.append(f.threads)
        out.at_s.append(f.start_s)
        out.worker.append(w)
        out.rows.append(f.batch.rows)
        out.lengths.append(f.batch.padded_tokens // f.batch.rows)
        out.explored.append(f.explored)
        out.latency_ms.extend((now_s - at) * 1000 for _, at in f.requests)
        if self.lanes and (not self._workers[w].queue or self._place_held(w)):
            # a served forward's end wakes the shadow loop: idle now, or a claim waits for it
            self._workers[w].next_poll = now_s

    def _watch_records(self) -> None:
        """Each worker's record watch (``AdaptiveThreads.poll_record``, every ``watch_s``,
        the workers' watches staggered across it), and its shadow loop's flush of what it
        learned where one is due: what one worker learned reaches the others' as a
        sibling's count (R4.12, ``siblings``)."""
        for w, k in enumerate(self._workers):
            if k.next_watch <= self.clock.now_s:
                tuner = self.tuners[w]
                if tuner.flush_due():
                    tuner.flush()
                tuner.poll_record()
                k.next_watch = self.clock.now_s + tuner.settings.watch_s

    def _schedule_poll(self, w: int) -> None:
        lane = self.lanes[w]
        self._workers[w].next_poll = math.inf if lane.in_flight is not None or \
            not self.tuners[w].pending_shadows() else self.clock.now_s + POLL_S

    def _poll_lanes(self) -> None:
        for w, lane in enumerate(self.lanes):
            if self._workers[w].next_poll <= self.clock.now_s and lane.in_flight is None:
                lane.wake()
                self._schedule_poll(w)

    def close(self) -> None:
        for lane in self.lanes:
            lane.stop()
        for tuner in self.tuners:
            tuner.close()
        self.lanes = []
        self.clock.forwards = [f for f in self.clock.forwards if not f.shadow]
        if self._record is not None:
            self._record.close()
        self._tmp.cleanup()
