"""A simulated many-core host for the tuner: the real ``AdaptiveThreads`` (every decision its
own), a fake clock, and a forward-time model in place of a model and its cores.

Forward-time model: ``t(T, n) = overhead + per_token * T * (serial + (1 - serial) / e) +
sync * (n - 1)`` ms for ``T`` padded tokens at ``n`` threads, where ``e = n`` while ``n`` fits
in the free cores and ``free**2 / n`` when it does not (an OpenMP team oversubscribed past the
free cores waits at every barrier for its descheduled threads). Fit in shape to FACTS.md:
``per_token`` and ``overhead`` to the L3 onnxruntime row at 1 thread (2.7 ms at 16 tokens, 34
ms at 256), ``serial`` and ``sync`` to the published 16-32-core record (a short input 1.8x
faster at 1 thread than at 16, a ~1,200-token input 2.4x faster at 16 than at 1): serial 0.35,
sync 0.224 ms per extra thread. Times get a small seeded lognormal noise.

The engine is one served forward at a time, in arrival order; shadows run in the gaps (the
tuner's ``step``). A shadow that would run past the next arrival has that served forward
start during it, as on a real host, so the tuner sees the overlap and does not keep the
sample. A neighbour takes ``k`` cores over ``[start_s, end_s)``; a shadow at more threads than
the cores left waits for them (the time its process would measure), so it is not a sample.
The tuner reads the cores the neighbours leave free (``free_cpus``, as ``FreeCpus`` reads them
from ``/proc``), or, without, probes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_srun.records.host_record import Coverage, Scope, Voucher
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode, allowed_counts


@dataclass(frozen=True)
class TimeModel:
    cores: int
    overhead_ms: float = 0.74
    per_token_ms: float = 0.1225
    serial: float = 0.35
    sync_ms: float = 0.224
    noise: float = 0.05  # lognormal sigma

    def forward_ms(self, padded_tokens: int, num_threads: int, free_cores: int) -> float:
        free = max(1, free_cores)
        eff = num_threads if num_threads <= free else free * free / num_threads
        return (self.overhead_ms + self.per_token_ms * padded_tokens
                * (self.serial + (1 - self.serial) / eff) + self.sync_ms * (num_threads - 1))

    def best(self, padded_tokens: int, counts: Sequence[int], free_cores: int) -> int:
        return min(counts, key=lambda n: self.forward_ms(padded_tokens, n, free_cores))


@dataclass(frozen=True)
class Neighbour:
    cores: int
    start_s: float
    end_s: float = math.inf


@dataclass(frozen=True)
class Arrival:
    at_s: float
    padded_tokens: int


@dataclass
class Outcome:
    served_ms: list[float] = field(default_factory=list)  # per forward, in order
    latency_ms: list[float] = field(default_factory=list)  # queueing plus forward
    served_threads: list[int] = field(default_factory=list)
    explored: list[bool] = field(default_factory=list)  # served at a count to time it
    at_s: list[float] = field(default_factory=list)  # when each forward started
    learned_at: dict[int, int] = field(default_factory=dict)  # range -> forwards seen there
    relearns: int = 0
    discarded: int = 0

    @property
    def mean_latency_ms(self) -> float:
        return float(np.mean(self.latency_ms))


def _batch(padded_tokens: int) -> TokenBatch:
    ids = np.ones((1, padded_tokens), dtype=np.int64)
    return TokenBatch(ids, ids)


def _outputs(padded_tokens: int) -> np.ndarray:
    """The same answer at every count: this simulates a vouched, bit-exact host."""
    return np.full((1, 4), float(padded_tokens), dtype=np.float32)


class SimulatedHost:
    """Runs a trace through a worker whose forwards the time model times. ``fixed``: every
    forward at that count (no tuner); else the real tuner in ``mode`` (vouched)."""

    def __init__(self, model: TimeModel, neighbours: Sequence[Neighbour] = (),
                 fixed: int | None = None, mode: AdaptiveMode = AdaptiveMode.SERVE,
                 settings: TunerSettings | None = None, seed: int = 0,
                 configured: int | None = None, free_cpus: bool = True) -> None:
        self.model, self.neighbours, self.fixed = model, tuple(neighbours), fixed
        self.now_s = 0.0
        self._rng = np.random.default_rng(seed)
        self._next: Arrival | None = None
        # a served forward that started during a shadow, and its count
        self._early: tuple[TokenBatch, int, bool] | None = None
        self.configured = configured or max(1, min(16, model.cores // 2))  # default: R2.3
        self.counts = allowed_counts(self.configured, model.cores)
        self.tuner: AdaptiveThreads | None = None
        if fixed is None:
            settings = settings or TunerSettings(background=False)
            self.tuner = AdaptiveThreads(mode, self.configured, self.counts,
                                         Scope("sim", "sim", "sim"), None, self._never,
                                         settings, clock=lambda: self.now_s,
                                         shadow_forward=self._shadow,
                                         pause_shadows=lambda frozen: frozen,
                                         free_cpu_s=self._free_s if free_cpus else None)
            self.tuner.locked_reason = None  # no golden check to run on a model
            big = 1 << 30  # a modelled host: every count and shape vouched for
            self.tuner.voucher = Voucher(1, 0, True, (Coverage(tuple(self.counts), big, 1, big,
                                                               big, big, 1),))

    def free_cores(self, at_s: float) -> int:
        taken = sum(n.cores for n in self.neighbours if n.start_s <= at_s < n.end_s)
        return max(1, self.model.cores - taken)

    def _free_s(self) -> tuple[float, float]:
        """Now, and the CPU seconds the neighbours left the worker so far
        (``FreeCpus.latest``)."""
        t = self.now_s
        return t, self.model.cores * t - sum(n.cores * (min(t, n.end_s) - n.start_s)
                                             for n in self.neighbours if n.start_s < t)

    def _ms(self, padded_tokens: int, n: int, at_s: float) -> float:
        ms = self.model.forward_ms(padded_tokens, n, self.free_cores(at_s))
        return ms * float(np.exp(self._rng.normal(0, self.model.noise)))

    @staticmethod
    def _never(batch: TokenBatch, n: int) -> ForwardResult:
        raise AssertionError("served forwards are simulated by run()")

    def _shadow(self, batch: TokenBatch, n: int) -> ForwardResult:
        ms = self._ms(batch.padded_tokens, n, self.now_s)
        free = self.free_cores(self.now_s)  # as its time: the cores left when it starts
        end_s = self.now_s + ms / 1000
        nxt = self._next
        if nxt is not None and end_s > nxt.at_s and self._early is None:
            self.now_s = max(self.now_s, nxt.at_s)
            served, explored = _batch(nxt.padded_tokens), self.tuner.explored
            self._early = (served, self.tuner.served_threads(served),
                           self.tuner.explored > explored)
        else:
            self.now_s = end_s
        # an idle-class shadow with more threads than free cores waits for the neighbour's
        # (a real one gets next to no CPU there; its process measures the wait)
        waited = ms / 1000 * (n - free) if n > free else 0.0
        return ForwardResult(_outputs(batch.padded_tokens), n, n, ms / 1000, waited)

    def run(self, trace: Sequence[Arrival]) -> Outcome:
        out = Outcome()
        seen: dict[int, int] = {}
        tuner = self.tuner
        for arrival in trace:
            self._next = arrival
            while tuner is not None and self.now_s < arrival.at_s and self._early is None:
                if not tuner.step():
                    if not self.now_s < tuner._sharing_at < arrival.at_s:
                        break
                    self.now_s = tuner._sharing_at  # the loop wakes when a shadow may start
            start_s = max(self.now_s, arrival.at_s)
            batch = _batch(arrival.padded_tokens)
            explored = False
            if tuner is None:
                n = self.fixed
            elif self._early is not None:
                (batch, n, explored), self._early = self._early, None
            else:
                before = tuner.explored
                n = tuner.served_threads(batch)
                explored = tuner.explored > before
            ms = self._ms(arrival.padded_tokens, n, start_s)
            self.now_s = start_s + ms / 1000
            out.served_ms.append(ms)
            out.latency_ms.append((self.now_s - arrival.at_s) * 1000)
            out.served_threads.append(n)
            out.explored.append(explored)
            out.at_s.append(start_s)
            if tuner is not None:
                tuner.observe(batch, ForwardResult(_outputs(arrival.padded_tokens), n, n,
                                                   ms / 1000))
                lo = size_range(arrival.padded_tokens)[0]
                seen[lo] = seen.get(lo, 0) + 1
                r = tuner.ranges.get(lo)
                if r is not None and r.learned is not None and lo not in out.learned_at:
                    out.learned_at[lo] = seen[lo]
        if tuner is not None:
            out.relearns = sum(r.relearns for r in tuner.ranges.values())
            out.discarded = tuner.discarded
        return out


def poisson_trace(rate_per_s: float, duration_s: float, sizes: Sequence[int],
                  seed: int = 0, start_s: float = 0.0) -> list[Arrival]:
    """Poisson arrivals, each a forward of one of ``sizes`` padded tokens (uniformly)."""
    rng = np.random.default_rng(seed)
    out, t = [], start_s
    while True:
        t += float(rng.exponential(1 / rate_per_s))
        if t >= start_s + duration_s:
            return out
        out.append(Arrival(t, int(sizes[int(rng.integers(len(sizes)))])))


def shifting_trace(seed: int) -> list[Arrival]:
    """Long inputs on a quiet host (0-300 s), the same beside a neighbour (300-600 s, give it
    as ``Neighbour(k, 300, 600)``), then a burst of short ones (600-900 s)."""
    long = [1024, 1024, 1024, 256, 16]
    return (poisson_trace(8, 300, long, seed=seed)
            + poisson_trace(8, 300, long, seed=seed + 1, start_s=300)
            + poisson_trace(40, 300, [16, 16, 16, 64, 256], seed=seed + 2, start_s=600))


def compare(cores: int, taken: int, seed: int = 10) -> dict[str, tuple[float, float]]:
    """Mean served forward ms and mean latency ms on the shifting trace: mode 2 (vouched)
    and every fixed allowed count."""
    model, neighbours = TimeModel(cores), [Neighbour(taken, 300, 600)]
    trace = shifting_trace(seed)
    if cores <= 4:  # a small host takes a quarter of the traffic
        trace = trace[::4]
    runs = {"adaptive (mode 2)": SimulatedHost(model, neighbours, seed=1).run(trace)}
    for n in SimulatedHost(model).counts:
        runs[f"fixed {n}"] = SimulatedHost(model, neighbours, fixed=n, seed=1).run(trace)
    return {k: (float(np.mean(o.served_ms)), o.mean_latency_ms) for k, o in runs.items()}


def main() -> None:
    """``python -m vllm_srun.tuner.simulate``: the shifting-load comparison as a table."""
    for cores, taken in ((4, 3), (16, 12), (64, 60)):
        print(f"\n{cores} cores, a neighbour takes {taken} from 300 s to 600 s")
        print("| worker | mean forward ms | mean latency ms |\n|---|---|---|")
        for name, (served, latency) in compare(cores, taken).items():
            print(f"| {name} | {served:.2f} | {latency:.2f} |")


if __name__ == "__main__":
    main()
