"""A simulated many-core host for the tuner (``python -m vllm_srun.tuner.simulate``): the real
``AdaptiveThreads`` in every worker, a virtual clock, and a forward-time model in place of a
model and its cores.

- The forward model (``tuner/sim_model.py``) is fitted to this host's forward table
  (``bench/results/forward_table.json``, ``python -m bench.forward_table``): per backend and
  precision, an overhead (part of it splitting across threads), sync, and work per row, per
  token and per token per token of length, with a serial fraction and a grain (small
  forwards split less), at 1 and 2 threads. Past 2 threads it follows a 16-core Intel
  Xeon's measured speed-ups over 2 threads (``sim_calibration.fit_many_core``, 4, 8 and 16
  threads on 7 shapes, ``bench/results/precision_xeon16.json``); a configuration that table
  lacks follows published many-core figures (``sim_calibration.fit_published``: a 16-vCPU
  EPYC's one-row times by length, a 16-core Arm host's quiet 1 vs 16 thread times, a long
  input's 16-thread speed-up).
- The host (``tuner/sim_host.py``) shares its cores among workers' served forwards (fair share
  at normal priority), a neighbour's threads, and idle-class shadows (only the cores left; they
  slow served forwards beside them); noise is a slowly varying host-wide factor times
  per-forward noise. Requests are rows of one length each, batched as the runtime batches them
  (``runtime.batching.next_batch``) into rows x length forwards. Each worker's shadow loop
  is the tuner's ``step`` run until it returns False, woken as ``tuner/shadow_loop.py``'s loop
  is (a served forward's end; every 0.05 s while ``pending_shadows``), on a thread of its own
  in lockstep with the virtual clock (``tuner/sim_lane.py``). Each worker's record watch
  and flushes run on the virtual clock too, on one shared record: a count one worker
  learned reaches the others as a sibling's (R4.12). The loop's warm-up of each count is
  left out.

What is fitted: per backend x precision, the host model's parameters (to every cell of the
measured table, least worst-cell relative error); past 2 threads, the contention and the
sync each thread adds (to the 16-core Xeon's speed-ups over 2 threads, least squares in log;
for other configurations the published 1/16-thread ratios and the EPYC's 16-thread length
curve). What is assumed: that the Xeon's speed-ups over its own 2 threads carry over to the
measured 2-vCPU host's 2-thread forward, and the published ratios, from other hosts and a
larger model, to this model as shares of its own overhead and work;
fair sharing of cores at normal priority (checked, not fitted, against the loaded Arm
figure); idle-class shadows slowing served forwards in proportion to the cores they use
(one 2-vCPU measurement); the noise's sizes and time constant; requests of one row each,
batched by the runtime's policy, dispatched to the worker with the fewest waiting.

- ``many_core``: 64 cores, 8 workers, Poisson arrivals of a mix of lengths, and a neighbour
  whose cores change at random between none and half the host: mode 2 against every fixed
  per-worker count. The scenario is set before any run and not tuned to the result.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_srun.tuner.adaptive import TunerSettings
from vllm_srun.tuner.core_rules import fair_share, grant, room
from vllm_srun.tuner.modes import allowed_counts
from vllm_srun.tuner.sim_calibration import REFERENCE, TimeModel, calibrated
from vllm_srun.tuner.sim_host import Arrival, CoresHook, Neighbour, Noise, Outcome, SimulatedHost
from vllm_srun.tuner.sim_model import ConfigFit

__all__ = ["Arrival", "ConfigFit", "Neighbour", "Noise", "Outcome", "SimulatedHost",
           "TimeModel", "calibrated", "herd", "many_core", "poisson_trace", "request_trace",
           "shifting_neighbour"]


# -- traffic -----------------------------------------------------------------------------------

def poisson_trace(rate_per_s: float, duration_s: float, sizes: Sequence[int],
                  seed: int = 0, start_s: float = 0.0) -> list[Arrival]:
    """Poisson arrivals, each a one-row request of one of ``sizes`` tokens (uniformly)."""
    rng = np.random.default_rng(seed)
    out, t = [], start_s
    while True:
        t += float(rng.exponential(1 / rate_per_s))
        if t >= start_s + duration_s:
            return out
        out.append(Arrival(t, int(sizes[int(rng.integers(len(sizes)))])))


def request_length(rng: np.random.Generator) -> int:
    """FACTS.md's mixed traffic: 70% short queries (8-32 tokens), 25% passages (64-256), 5%
    long (384-512), log-uniform within each."""
    lo, hi = ((8, 32), (64, 256), (384, 512))[int(rng.choice(3, p=(0.70, 0.25, 0.05)))]
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def request_trace(rate_per_s: float, duration_s: float, seed: int) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while (t := t + float(rng.exponential(1 / rate_per_s))) < duration_s:
        out.append(Arrival(t, request_length(rng)))
    return out


def trace_at_load(config: ConfigFit, load: float, workers: int, threads: int,
                  duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals of FACTS.md's length mix (``request_trace``) at ``load`` times what
    ``workers`` workers serve at ``threads`` threads each on a quiet host, one row per forward
    (a lower bound on capacity: batching raises it)."""
    rng = np.random.default_rng(seed)
    mean_ms = float(np.mean([config.quiet_ms(1, request_length(rng), threads)
                             for _ in range(4000)]))
    return request_trace(load * workers * 1000 / mean_ms, duration_s, seed)


def shifting_neighbour(cores: int, duration_s: float, seed: int,
                       mean_hold_s: float = 30.0) -> list[Neighbour]:
    """A neighbour holding a level drawn uniformly from 0..cores/2 busy threads, each level for
    an exponential time (mean ``mean_hold_s``)."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while t < duration_s:
        hold = float(rng.exponential(mean_hold_s))
        level = int(rng.integers(0, cores // 2 + 1))
        if level:
            out.append(Neighbour(level, t, min(duration_s, t + hold)))
        t += hold
    return out


# -- what a run shows -----------------------------------------------------------------------

@dataclass(frozen=True)
class Herd:
    """Do workers change their served count together (per size range: a worker serving
    two ranges at two learned counts is no change)? For each change, the other workers
    that changed within ``window_s`` either side (``coincident``, averaged), against what
    as many changes at independent, uniformly spread times would give (``expected``): a
    ``ratio`` near 1 is independent workers, far above 1 a herd. ``most_workers``: the
    most workers changing within one ``window_s``. Forwards mode 2 served at a count only
    to time it are not changes; serving below the learned count for the cores other tasks
    hold is."""

    window_s: float
    changes: int
    most_workers: int
    coincident: float
    expected: float

    @property
    def ratio(self) -> float:
        return self.coincident / self.expected if self.expected else 0.0


def herd(outcome: Outcome, workers: int, duration_s: float, window_s: float = 0.1) -> Herd:
    changes = sorted(outcome.changes)
    if not changes:
        return Herd(window_s, 0, 0, 0.0, 0.0)
    times = np.asarray([t for t, _, _ in changes])
    who = np.asarray([w for _, w, _ in changes])
    per_worker = np.bincount(who, minlength=workers)
    most, coincident, expected = 0, 0.0, 0.0
    for t, w, _ in changes:
        lo = np.searchsorted(times, t - window_s, "left")
        near = set(who[lo:np.searchsorted(times, t + window_s, "right")].tolist())
        ahead = set(who[np.searchsorted(times, t, "left"):np.searchsorted(
            times, t + window_s, "right")].tolist())
        most = max(most, len(ahead))
        coincident += len(near - {w})
        # independent: each other worker changes within +-window with its own rate
        rates = np.delete(per_worker, w) / duration_s
        expected += float(np.sum(1 - np.exp(-rates * 2 * window_s)))
    return Herd(window_s, len(changes), most, coincident / len(changes),
                expected / len(changes))


@dataclass(frozen=True)
class RunSummary:
    name: str
    mean_forward_ms: float
    mean_latency_ms: float
    p99_latency_ms: float
    forwards: int
    max_served_threads: int  # all workers together, at any instant
    over_cores_share: float  # of the run's time, the share they passed the cores
    herd: Herd | None
    # mean forward ms of the forwards started in each ``SPAN_S`` of the run, in order, and
    # the share of them served only to time a count (mode 2 exploring)
    spans: tuple[tuple[float, float], ...] = ()


SPAN_S = 30.0  # the table's time spans: learning's cost shows in the first


def summarise(name: str, outcome: Outcome, workers: int, duration_s: float) -> RunSummary:
    at, ms = np.asarray(outcome.at_s), np.asarray(outcome.served_ms)
    explored = np.asarray(outcome.explored, dtype=bool)
    spans = tuple((float(ms[m].mean()), float(explored[m].mean()))
                  for k in range(math.ceil(duration_s / SPAN_S))
                  if (m := (at >= k * SPAN_S) & (at < (k + 1) * SPAN_S)).any())
    return RunSummary(name, float(np.mean(outcome.served_ms)), outcome.mean_latency_ms,
                      float(np.percentile(outcome.latency_ms, 99)), len(outcome.served_ms),
                      outcome.max_served_threads,
                      outcome.over_cores_s / max(1e-9, max(outcome.at_s, default=0.0)),
                      herd(outcome, workers, duration_s), spans)


def ledger(cores: int, configured: int, workers: int) -> CoresHook:
    """``tuner/cores.py``'s rules as the host's hook: a count serves where the other workers'
    served threads, a fair share of the room for each other worker serving nothing
    (``fair_share``), and it fit the cores
    the neighbour leaves (``room``, as read over the last window), else the largest count
    below it the tuner may serve that does (``grant``; the ledger's linger after a forward
    ends is not modelled)."""
    def hook(worker: int, want: int, others: Sequence[int], lower: Sequence[int],
             held: float | None) -> int:
        budget = room(cores, held)
        return grant(want, configured, sum(others), workers - 1 - len(others), budget, lower,
                     fair_share(budget, workers))

    return hook


def many_core(seed: int = 1, duration_s: float = 300.0, cores: int = 64, workers: int = 8,
              load: float = 0.5, configured: int | None = None, config: ConfigFit | None = None,
              cores_hook: CoresHook | None = None,
              settings: TunerSettings | None = None) -> list[RunSummary]:
    """Mode 2 and every fixed per-worker count on the same trace and neighbour; unless
    ``cores_hook`` replaces it, mode 2 also as docs/pool.md advises for several workers
    (configured ``cores // workers``, ``tuner/cores.py``'s ledger as the hook).

    Arrivals: Poisson, FACTS.md's length mix, at ``load`` times what the workers serve at
    ``cores // workers`` threads each on a quiet host (one row per forward, a lower bound on
    capacity: batching, up to 32 rows and 2,048 padded tokens as the runtime's defaults,
    raises it). Neighbour: ``shifting_neighbour`` (0 to half the cores).
    ``configured`` (default R2.3's: half the cores, at most 16: every worker's default
    on a host it does not split) is mode 2's configured count."""
    config = config or calibrated()  # the measured host's default backend
    trace = trace_at_load(config, load, workers, max(1, cores // workers), duration_s, seed)
    neighbours = shifting_neighbour(cores, duration_s, seed + 1)
    configured = configured or max(1, min(16, cores // 2))
    counts = allowed_counts(configured, cores)

    def host(fixed: int | None) -> SimulatedHost:
        return SimulatedHost(TimeModel(cores, config), neighbours, fixed, seed=seed,
                             configured=configured, counts=counts, workers=workers,
                             cores_hook=cores_hook, settings=settings, max_rows=32,
                             max_tokens=2048)

    runs = [summarise(f"mode 2 (configured {configured})", host(None).run(trace), workers,
                      duration_s)]
    if cores_hook is None:  # as docs/pool.md advises: --threads cores / workers, the ledger
        split = max(1, cores // workers)
        ledgered = SimulatedHost(TimeModel(cores, config), neighbours, None, seed=seed,
                                 configured=split, counts=allowed_counts(split, cores),
                                 workers=workers, cores_hook=ledger(cores, split, workers),
                                 settings=settings, max_rows=32, max_tokens=2048)
        runs.append(summarise(f"mode 2 + core ledger (configured {split})",
                              ledgered.run(trace), workers, duration_s))
    runs += [summarise(f"fixed {n}", host(n).run(trace), workers, duration_s)
             for n in counts]
    return runs


def table(runs: Sequence[RunSummary], cores: int) -> list[str]:
    out = [f"| worker | mean forward ms | mean latency ms | p99 latency ms | forwards | most "
           f"served threads at once (of {cores} cores) | time over the cores | count "
           "changes | other workers changing within 0.1 s of one: seen / if independent "
           f"| most workers changing in 0.1 s | mean forward ms per {SPAN_S:.0f} s (share "
           "served only to time a count) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        h = r.herd
        out.append(f"| {r.name} | {r.mean_forward_ms:.2f} | {r.mean_latency_ms:.2f} | "
                   f"{r.p99_latency_ms:.1f} | {r.forwards} | {r.max_served_threads} | "
                   f"{r.over_cores_share:.1%} | {h.changes} | {h.coincident:.2f} / "
                   f"{h.expected:.2f} | {h.most_workers} | "
                   + ", ".join(f"{m:.1f}" + (f" ({x:.0%})" if x else "") for m, x in r.spans)
                   + " |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m vllm_srun.tuner.simulate [--model table|reference] [--seconds S]
    [--seeds 1,2]``: the 64-core, 8-worker comparison as a table per seed, on the measured
    host's default backend (``table``) or the fixed reference model."""
    parser = argparse.ArgumentParser(prog="python -m vllm_srun.tuner.simulate")
    parser.add_argument("--model", choices=("table", "reference"), default="table")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    config = calibrated() if args.model == "table" else REFERENCE
    for seed in seeds:
        print(f"\n64 cores, 8 workers, a neighbour shifting between none and half the cores, "
              f"50% load, {args.seconds:.0f} s, model {args.model}, seed {seed}")
        print("\n".join(table(many_core(seed, args.seconds, config=config), 64)), flush=True)


if __name__ == "__main__":
    main()
