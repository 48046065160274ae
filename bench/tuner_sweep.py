"""The tuner's learning constants swept on the simulated host (``tuner/simulate.py``): for each
constant, a few values around its default, one at a time, mode 2 run on the same traces as at
the default and as every fixed count.

    python -m bench.tuner_sweep [--seeds 1,2,3,4,5,6] [--only min_samples window ...]
                                [--jobs 2] [--out bench/results/tuner_sweep.json]

Scenarios (set before any run, not tuned to a result), each on the forward model fitted to
this host's measured table (``sim_calibration.calibrated``, the default backend, float32):

- ``2 cores``: one worker on 2 cores, configured 1 (R2.3's default there), counts 1 and 2,
  Poisson arrivals at 60% of what fixed 1 serves, FACTS.md's length mix, 120 s;
- ``2 cores, neighbour``: the same beside a neighbour holding one core 2 s of every 4;
- ``16 cores``: two workers on 16 cores, configured 8 each, counts 1-16, sharing the cores
  through the core ledger as a pool's workers do (``simulate.ledger``), 50% load, a neighbour
  shifting between none and half the cores (``simulate.shifting_neighbour``), 60 s;
- ``64 cores``: the many-core scenario of ``tuner/simulate.py`` (8 workers configured 8,
  the ledger, 50% load, the shifting neighbour), 120 s.

Per scenario and seed: the mean request latency (queue plus forward) of mode 2 at the defaults
and of every fixed count (mode 2 over its configured count: what turning it on changes). Per
constant and value: mode 2's over the best fixed count's on the same trace (``vs best
fixed``: learning's cost included), and over mode 2 at the default settings (``vs default``,
paired by seed: the simulator is deterministic per seed, so two runs at one setting give
exactly 1.0 and there is no other null check). Each figure is the median over seeds with a
bootstrap 95% interval. What the simulator models and
assumes is in ``tuner/simulate.py``; what it leaves out (the real kernel's run delay, the
frontend's CPU) a sweep here cannot see.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench.stats import bootstrap
from vllm_srun.tuner.modes import allowed_counts
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.sim_calibration import TimeModel, calibrated
from vllm_srun.tuner.simulate import (
    Neighbour,
    SimulatedHost,
    ledger,
    shifting_neighbour,
    trace_at_load,
)

OUT = Path(__file__).parent / "results" / "tuner_sweep.json"
# each constant's values, its default among them
SWEEP: dict[str, tuple] = {
    "min_samples": (4, 8, 12, 16, 24),
    "window": (2, 4, 8, 16),
    "margin": (0.0, 0.02, 0.05, 0.1, 0.2),
    "audit_every": (4, 8, 16, 32),
    "relearn_factor": (1.25, 1.5, 2.0, 3.0),
    "max_samples": (16, 48, 96),
    "budget_fraction": (0.25, 0.5, 1.0),
    "starved_s": (0.25, 1.0, 4.0),
    "retry_backoff_max_s": (0.0, 1.0, 8.0, 60.0),
    "held_out_s": (2.5, 5.0, 10.0, 20.0, 1e9),
}


def _scenario(name: str, seed: int, config):
    """(cores, workers, configured, trace, neighbours, duration) of one scenario and seed."""
    if name.startswith("2 cores"):
        cores, workers, configured, duration, load = 2, 1, 1, 120.0, 0.6
    elif name == "16 cores":
        cores, workers, configured, duration, load = 16, 2, 8, 60.0, 0.5
    else:
        cores, workers, configured, duration, load = 64, 8, 8, 120.0, 0.5
    per_worker = max(1, cores // workers) if workers > 1 else configured
    trace = trace_at_load(config, load, workers, per_worker, duration, seed)
    if name == "2 cores":
        neighbours = []
    elif name == "2 cores, neighbour":
        neighbours = [Neighbour(1, t, t + 2.0) for t in np.arange(0.0, duration, 4.0)]
    else:
        neighbours = shifting_neighbour(cores, duration, seed + 1)
    return cores, workers, configured, trace, neighbours


SCENARIOS = ("2 cores", "2 cores, neighbour", "16 cores", "64 cores")


def _latency(config, scenario, seed: int, fixed: int | None,
             settings: TunerSettings | None = None) -> float:
    cores, workers, configured, trace, neighbours = scenario
    hook = ledger(cores, configured, workers) if workers > 1 and fixed is None else None
    host = SimulatedHost(TimeModel(cores, config), neighbours, fixed, seed=seed,
                         configured=configured, counts=allowed_counts(configured, cores),
                         workers=workers, settings=settings, max_rows=32, max_tokens=2048,
                         cores_hook=hook)
    return host.run(trace).mean_latency_ms


def _summary(values: Sequence[float]) -> dict:
    ci = bootstrap(list(values), lambda v: float(np.median(v)))
    return {"median": ci.estimate, "ci95": [ci.lo, ci.hi],
            "per_seed": [round(float(v), 4) for v in values]}


def _run(task: tuple) -> float:
    """One run: (scenario, seed, fixed count or None for mode 2, settings)."""
    name, seed, fixed, settings = task
    config = calibrated()
    return _latency(config, _scenario(name, seed, config), seed, fixed, settings)


def _runs(tasks: Sequence[tuple], jobs: int) -> dict[tuple, float]:
    """Each task's mean latency, on ``jobs`` processes (the simulator is deterministic per
    seed: the same figures as one process, in less wall time)."""
    if jobs <= 1:
        return {t: _run(t) for t in tasks}
    with ProcessPoolExecutor(jobs) as pool:
        return dict(zip(tasks, pool.map(_run, tasks), strict=True))


def sweep(seeds: Sequence[int], only: Sequence[str],
          scenarios: Sequence[str] = SCENARIOS, jobs: int = 1) -> dict:
    config = calibrated()
    base = TunerSettings.of(background=False)
    out: dict = {"seeds": list(seeds), "scenarios": {}}
    for name in scenarios:
        t0 = time.monotonic()
        _, _, configured, _, _ = sc = _scenario(name, seeds[0], config)
        counts = allowed_counts(configured, sc[0])
        settings = {(key, value): base if value == base.value(key) else
                    base.with_(**{key: value}) for key in only for value in SWEEP[key]}
        tasks = [(name, s, n, None) for s in seeds for n in counts] + [
            (name, s, None, v) for v in dict.fromkeys([base, *settings.values()])
            for s in seeds]
        ran = _runs(tasks, jobs)
        fixed = {s: {n: ran[(name, s, n, None)] for n in counts} for s in seeds}
        default = {s: ran[(name, s, None, base)] for s in seeds}
        fixed_best = {s: min(fixed[s].values()) for s in seeds}
        rows = []
        for key in only:
            for value in SWEEP[key]:
                lat = {s: ran[(name, s, None, settings[(key, value)])] for s in seeds}
                rows.append({"constant": key, "value": value,
                             "default": value == base.value(key),
                             "vs_best_fixed": _summary([lat[s] / fixed_best[s] for s in seeds]),
                             "vs_default": _summary([lat[s] / default[s] for s in seeds])})
                print(f"{name} {key}={value}: vs best fixed "
                      f"{rows[-1]['vs_best_fixed']['median']:.3f}, vs default "
                      f"{rows[-1]['vs_default']['median']:.3f} "
                      f"{rows[-1]['vs_default']['ci95']}", flush=True)
        out["scenarios"][name] = {
            "rows": rows, "seconds": round(time.monotonic() - t0, 1),
            "fixed_ms": {str(n): _summary([fixed[s][n] for s in seeds])["median"]
                         for n in fixed[seeds[0]]},
            "default_ms": _summary([default[s] for s in seeds])["median"],
            "default_vs_configured": _summary([default[s] / fixed[s][configured]
                                               for s in seeds]),
            "default_vs_best_fixed": _summary([default[s] / fixed_best[s] for s in seeds])}
    return out


def table(result: dict) -> list[str]:
    names = list(result["scenarios"])
    lines = ["| scenario | mode 2 at the defaults, mean latency ms | each fixed count (median "
             "over seeds) | mode 2 / its configured count (95% CI) | mode 2 / the best fixed "
             "count (95% CI) |", "|---|---|---|---|---|"]
    for n in names:
        sc = result["scenarios"][n]
        c, b = sc["default_vs_configured"], sc.get("default_vs_best_fixed")
        fixed = ", ".join(f"{k}: {v:.1f}" for k, v in sc["fixed_ms"].items())
        best = f"{b['median']:.3f} ({b['ci95'][0]:.3f}-{b['ci95'][1]:.3f})" if b else "-"
        lines.append(f"| {n} | {sc['default_ms']:.1f} | {fixed} | {c['median']:.3f} "
                     f"({c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}) | {best} |")
    lines += ["","| constant | value | " + " | ".join(f"{n}: vs best fixed / vs default (95% CI)"
                                                  for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    by_key: dict[tuple, list[str]] = {}
    for n in names:
        for r in result["scenarios"][n]["rows"]:
            b, d = r["vs_best_fixed"], r["vs_default"]
            by_key.setdefault((r["constant"], r["value"], r["default"]), []).append(
                f"{b['median']:.3f} / {d['median']:.3f} ({d['ci95'][0]:.3f}-{d['ci95'][1]:.3f})")
    for (key, value, is_default), cells in by_key.items():
        shown = f"**{value}** (default)" if is_default else str(value)
        lines.append(f"| {key} | {shown} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3,4,5,6")
    p.add_argument("--only", nargs="*", choices=list(SWEEP), default=list(SWEEP),
                   help="constants to sweep; none: only the defaults against each fixed count")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--jobs", type=int, default=1,
                   help="processes to run the simulations on (each run is one process's)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    if len(seeds) < 2:
        p.error("--seeds needs at least two seeds for an interval")
    result = sweep(seeds, args.only, args.scenarios, args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table(result)))
    if any(math.isnan(r["vs_default"]["median"]) for s in result["scenarios"].values()
           for r in s["rows"]):
        raise SystemExit("a run gave no latency")


if __name__ == "__main__":
    main()
