"""The simulated host's cores on its virtual clock (``tuner/sim_host.py``): every forward in
flight (served and shadow) with the work it has left, the rate each progresses at, and the
host-wide slowness.

How it works: work is in quiet-host milliseconds (``ConfigFit.quiet_ms`` times a per-forward
lognormal noise). Between events every forward progresses at the rate ``cores_share`` gives
it for the threads that want the cores now, divided by a host-wide slowness factor (a
log-Ornstein-Uhlenbeck process: the correlated part of the noise, ``HostSlowness``).

Invariant: ``now_s`` only moves in ``advance``, which every forward's progress follows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from vllm_srun.runtime.types import TokenBatch
from vllm_srun.tuner.free_cpus import share_of_pool
from vllm_srun.tuner.sim_model import ConfigFit, cores_share
from vllm_srun.tuner.sim_types import InFlight, Neighbour, Noise

# the host-wide factor's grid: far finer than its time constant (30 s), coarser than a forward
HOST_STEP_S = 0.05


class HostSlowness:
    """The host-wide factor as a function of virtual time: a log-OU path on a fixed grid,
    drawn from a generator of its own. Every run of one seed (mode 2 and each fixed count)
    meets the same slow and fast stretches at the same times, so a ratio between two of them
    is not also a ratio of two noise paths (common random numbers). Drawn per event from the
    run's one stream instead, the factor's path followed each run's own events: with a 30-s
    time constant over a 120-s run, two runs of one seed differed by several percent from
    the noise alone."""

    def __init__(self, noise: Noise, rng: np.random.Generator) -> None:
        self._rng = np.random.default_rng(int(rng.integers(2**63)))
        self._decay = math.exp(-HOST_STEP_S / noise.host_tau_s)
        self._kick = noise.host * math.sqrt(1 - self._decay * self._decay)
        self._path = [0.0]

    def log_at(self, at_s: float) -> float:
        k = max(0, int(at_s / HOST_STEP_S))
        while len(self._path) <= k:
            self._path.append(self._path[-1] * self._decay
                              + self._kick * float(self._rng.normal()))
        return self._path[k]


class CoreClock:
    """``cores`` cores running ``fit``'s forwards beside ``neighbours``, for ``workers``
    workers; ``rng`` draws the noise (shared with the host: one stream, one run)."""

    def __init__(self, fit: ConfigFit, cores: int, neighbours: Sequence[Neighbour],
                 noise: Noise, rng: np.random.Generator, workers: int,
                 pooled: bool = False) -> None:
        """``pooled``: the workers share a core ledger, and each reads its share of the free
        cores beside its siblings (``free_cpus.share_of_pool``), not their threads as a
        neighbour's."""
        self.fit, self.cores, self.neighbours = fit, cores, tuple(neighbours)
        self.pooled = pooled
        self.noise, self.rng = noise, rng
        self.now_s = 0.0
        self.slowness = HostSlowness(noise, rng)  # drawn first: the same path every run
        self.forwards: list[InFlight] = []
        self.free_s = [0.0] * workers  # CPU seconds other tasks left each worker so far
        self.held_s = 0.0  # CPU seconds the neighbour ran so far

    def start_forward(self, w: int, batch: TokenBatch, n: int, shadow: bool) -> InFlight:
        ms = self.fit.quiet_ms(batch.rows, int(batch.input_ids.shape[1]), n)
        ms *= float(np.exp(self.rng.normal(0, self.noise.forward)))
        fwd = InFlight(w, n, ms, self.now_s, shadow, batch)
        self.forwards.append(fwd)
        return fwd

    def neighbour_threads(self, at_s: float) -> float:
        return sum(n.cores for n in self.neighbours if n.start_s <= at_s < n.end_s)

    def rates(self, frozen: Callable[[int], bool]) -> tuple[list[float], float, float]:
        """Each forward's rate (a worker's shadow side ``frozen`` gets none), the share a
        shadow gets, and the share served threads and the neighbour get."""
        served = sum(f.threads for f in self.forwards if not f.shadow)
        neighbour = self.neighbour_threads(self.now_s)
        shadows = sum(f.threads for f in self.forwards if f.shadow and not frozen(f.worker))
        share = cores_share(self.cores, served + neighbour, shadows)
        slow = math.exp(self.slowness.log_at(self.now_s))
        rates = [0.0 if f.shadow and frozen(f.worker) else
                 (share.shadow if f.shadow else share.rate(f.threads)) / slow
                 for f in self.forwards]
        return rates, share.shadow, min(1.0, self.cores / max(served + neighbour, 1e-9))

    def advance(self, to_s: float, rates: list[float], q_shadow: float, q: float) -> float:
        """Move the clock to ``to_s``, every forward on at its rate; returns the seconds
        of it the served threads of all workers passed the cores."""
        dt = to_s - self.now_s
        if dt <= 0:
            return 0.0
        neighbour = self.neighbour_threads(self.now_s) * q
        self.held_s += neighbour * dt
        per_worker = [0.0] * len(self.free_s)
        for f, r in zip(self.forwards, rates, strict=True):
            f.left_ms -= r * dt * 1000
            if f.shadow and r > 0:
                f.waited_s += f.threads * (1 - q_shadow) * dt
            elif not f.shadow:
                per_worker[f.worker] += f.threads * q
        total = sum(per_worker)
        over_s = dt if sum(f.threads for f in self.forwards if not f.shadow) > self.cores \
            else 0.0
        free = self.cores - neighbour - total  # what no served thread used
        for w in range(len(self.free_s)):
            others = per_worker[:w] + per_worker[w + 1:]
            self.free_s[w] += dt * (share_of_pool(free + per_worker[w], others)
                                    if self.pooled else max(0.0, free + per_worker[w]))
        self.now_s = to_s
        return over_s
