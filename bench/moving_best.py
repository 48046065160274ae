"""Mode 2 where the best count moves with input size, simulated (``tuner/simulate.py``): one
worker on 16 cores running the torch bfloat16 forward model whose speed-ups past 2 threads
follow the 16-core Xeon with AMX (``sim_calibration.calibrated("torch", "bfloat16")``, fitted
to ``bench/results/precision_xeon16.json``), on which 4 threads are fastest for short queries,
8 for single passages and 16 for batches of passages. No device machine is needed.

    python -m bench.moving_best [--seeds 1,...,10] [--loads 0.1,0.5,0.9] [--seconds 120]
                                [--out bench/results/moving_best.json]

Per load and seed (a seed is one paired round: mode 2 and every fixed count serve the same
Poisson trace of FACTS.md's length mix), every server's mean request latency, and per load
the median over seeds with a bootstrap 95% interval of:

- ``vs_best_fixed``: the best fixed count's mean latency over mode 2's (above 1: mode 2 ahead
  of every fixed count), the best fixed count chosen per seed;
- ``vs_oracle``: mode 2's choices against the per-shape oracle over its own forwards: the
  model's quiet time of each forward at the fastest count, summed, over the same at the count
  mode 2 served it (learning's forwards served only to time a count included; 1.0: every
  forward at its shape's best count). The served times themselves carry noise and shadow
  interference, which the latencies above include.

Loads are open-loop fractions of what the configured count (R2.3's default, 8) serves one row
at a time on a quiet host: the lowest stands in for one closed-loop client (forwards rarely
overlap), the highest for many (batches form). The simulator is deterministic per seed, so two
identical servers give exactly the same figures: there is no null check to print, and the
interval is across seeds (traces and noise draws), not across runs of one trace.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.stats import bootstrap
from vllm_srun.tuner.modes import allowed_counts
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.sim_calibration import ConfigFit, TimeModel, calibrated
from vllm_srun.tuner.simulate import SimulatedHost, trace_at_load

OUT = Path(__file__).parent / "results" / "moving_best.json"
CORES = 16
CONFIGURED = 8  # R2.3's default on 16 cores: half of them


def oracle_ratio(config: ConfigFit, rows: Sequence[int], lengths: Sequence[int],
                 threads: Sequence[int], counts: Sequence[int]) -> float:
    """Quiet time of the forwards at each one's fastest count over the same at the counts
    served (1.0: every forward at its best)."""
    best = served = 0.0
    for r, n_len, n in zip(rows, lengths, threads, strict=True):
        best += min(config.quiet_ms(r, n_len, c) for c in counts)
        served += config.quiet_ms(r, n_len, n)
    return best / served


def round_of(config: ConfigFit, load: float, seed: int, seconds: float) -> dict:
    """One seed at one load: every server's mean latency on the same trace."""
    trace = trace_at_load(config, load, 1, CONFIGURED, seconds, seed)
    counts = allowed_counts(CONFIGURED, CORES)

    def host(fixed: int | None) -> SimulatedHost:
        return SimulatedHost(TimeModel(CORES, config), (), fixed, seed=seed,
                             configured=CONFIGURED, counts=counts,
                             settings=TunerSettings.of(background=False), max_rows=32,
                             max_tokens=2048)

    mode2 = host(None).run(trace)
    fixed = {n: host(n).run(trace).mean_latency_ms for n in counts}
    return {"requests": len(trace), "mode2_ms": mode2.mean_latency_ms,
            "fixed_ms": {str(n): ms for n, ms in fixed.items()},
            "vs_best_fixed": min(fixed.values()) / mode2.mean_latency_ms,
            "vs_oracle": oracle_ratio(config, mode2.rows, mode2.lengths,
                                      mode2.served_threads, counts),
            "served_threads": {str(n): int(np.sum(np.asarray(mode2.served_threads) == n))
                               for n in counts}}


def summary(values: Sequence[float]) -> dict:
    ci = bootstrap(list(values), lambda v: float(np.median(v)))
    return {"median": ci.estimate, "ci95": [ci.lo, ci.hi],
            "per_seed": [round(float(v), 4) for v in values]}


def run(seeds: Sequence[int], loads: Sequence[float], seconds: float) -> dict:
    config = calibrated("torch", "bfloat16")
    out: dict = {"cores": CORES, "configured": CONFIGURED, "seconds": seconds,
                 "seeds": list(seeds), "levels": {}}
    for load in loads:
        t0 = time.monotonic()
        rounds = [round_of(config, load, s, seconds) for s in seeds]
        level = {"vs_best_fixed": summary([r["vs_best_fixed"] for r in rounds]),
                 "vs_oracle": summary([r["vs_oracle"] for r in rounds]),
                 "rounds": rounds, "wall_s": round(time.monotonic() - t0, 1)}
        out["levels"][f"{load:g}"] = level
        print(f"load {load:g}: mode 2 vs best fixed {level['vs_best_fixed']['median']:.3f} "
              f"{[round(x, 3) for x in level['vs_best_fixed']['ci95']]}, vs oracle "
              f"{level['vs_oracle']['median']:.3f} "
              f"{[round(x, 3) for x in level['vs_oracle']['ci95']]} "
              f"({level['wall_s']:.0f} s)", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.moving_best")
    parser.add_argument("--seeds", default=",".join(str(s) for s in range(1, 11)))
    parser.add_argument("--loads", default="0.1,0.5,0.9")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        parser.error(f"--seeds and --loads take numbers separated by commas, got "
                     f"{args.seeds!r} and {args.loads!r}")
    if args.seconds <= 0 or not all(0 < x < 1 for x in loads):
        parser.error("--seconds must be > 0 and every load in (0, 1)")
    result = run(seeds, loads, args.seconds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
