"""What a shadow's measurement says a served forward costs, side by side with served forwards.

In mode 1 answers stay at the configured count, so another count is timed only by shadows:
forwards in an idle-class (``SCHED_IDLE``) process that yield to every other task. The
estimator turns a shadow's time into what that count would cost a served forward with
``samples.served_cost_ms``: its wall time less its threads' run delay per thread (the time
another task held a CPU it wanted). This bench measures, for the same batches, under the same
neighbour, one after another:

- a **served** forward: in this process, at normal priority, on a thread of the count (what a
  worker serves);
- a **shadow** forward: in the real ``ShadowProcess``, its wall time and run delay, and what
  ``served_cost_ms`` makes of them.

Neighbours: none; a process spinning on one core; the same process spinning 2 s of every 4.
Per round and (neighbour, shape, count), each side's median of ``--reps`` forwards; the ratio
shadow / served per round, with its median over rounds and a bootstrap 95% interval. A ratio
near 1 means the shadow's converted time predicts the served cost; below 1, the shadow
promises a count more than a served forward gets. A shadow whose threads waited for most of
its time gives no figure (``samples.MAX_WAITED_SHARE``). The last table says whether the
count that is fastest by the shadows' figures is the count that is fastest served.

    python -m bench.shadow_vs_served [--rounds 8] [--reps 3] [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

from bench.stats import median_interval
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.types import TokenBatch
from vllm_srun.tuner.samples import served_cost_ms
from vllm_srun.tuner.shadows import ShadowProcess

SHAPES = ((1, 16), (1, 128), (8, 64), (16, 128))  # rows x padded length
COUNTS = (1, 2)
# neighbour -> (seconds spinning, period): none, one core always, one core 2 s of every 4
NEIGHBOURS = {"none": None, "one core": (1.0, 1.0), "one core 2 s of 4": (2.0, 4.0)}


def _spin(hold_s: float, period_s: float) -> None:
    while True:
        start = time.monotonic()
        while time.monotonic() - start < hold_s:
            pass
        time.sleep(period_s - hold_s)


def _batch(rows: int, length: int, rng: np.random.Generator) -> TokenBatch:
    ids = rng.integers(1000, 29000, size=(rows, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return TokenBatch(ids, np.ones_like(ids))


def _side_by_side(served, shadow: ShadowProcess, batch: TokenBatch, n: int, reps: int
                  ) -> dict[str, float]:
    """Medians of ``reps`` served and ``reps`` shadow forwards, interleaved."""
    served_ms, wall_ms, cost_ms, waited_ms = [], [], [], []
    for _ in range(reps):
        r = served(batch, n)
        served_ms.append(1000 * r.forward_s)
        s = shadow.forward(batch, n)
        wall_ms.append(1000 * s.forward_s)
        cost_ms.append(served_cost_ms(s.forward_s, s.waited_s, n))  # None: no sample
        waited_ms.append(1000 * (s.waited_s or 0.0))
    kept = [c for c in cost_ms if c is not None]
    return {"served_ms": statistics.median(served_ms), "shadow_wall_ms": statistics.median(
        wall_ms), "shadow_cost_ms": statistics.median(kept) if kept else None,
        "shadow_no_sample": len(cost_ms) - len(kept),
        "shadow_waited_ms": statistics.median(waited_ms)}


def run(model: str, backend_name: str, rounds: int, reps: int, seed: int) -> dict:
    manifest = resolve(model)
    backend = load_backend(manifest, backend_name)
    context = ThreadContext()

    def served(batch: TokenBatch, n: int):
        return context.run(n, lambda: backend.forward(batch, n))

    shadow = ShadowProcess(manifest, backend_name)
    rng = np.random.default_rng(seed)
    order = random.Random(seed)
    batches = {shape: _batch(*shape, rng) for shape in SHAPES}
    for batch in batches.values():  # warm both sides at every count
        for n in COUNTS:
            _side_by_side(served, shadow, batch, n, 2)
    cells: list[dict] = []
    try:
        for r in range(rounds):
            for name, spin in order.sample(list(NEIGHBOURS.items()), len(NEIGHBOURS)):
                neighbour = None
                if spin is not None:
                    neighbour = multiprocessing.get_context("spawn").Process(
                        target=_spin, args=spin, daemon=True)
                    neighbour.start()
                    time.sleep(0.5)
                try:
                    for shape in order.sample(SHAPES, len(SHAPES)):
                        for n in order.sample(COUNTS, len(COUNTS)):
                            got = _side_by_side(served, shadow, batches[shape], n, reps)
                            cells.append({"round": r, "neighbour": name, "rows": shape[0],
                                          "length": shape[1], "threads": n, **got})
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.join()
            print(f"round {r + 1}/{rounds}; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shadow.close()
    return {"model": model, "backend": backend_name, "rounds": rounds, "reps": reps,
            "load_1_5_15_min_end": [round(x, 2) for x in os.getloadavg()], "cells": cells}


def _ratio(cells: list[dict], key: str) -> str:
    """The median over rounds of ``key`` / served time, where the shadow gave a figure."""
    return median_interval([c[key] / c["served_ms"] for c in cells
                            if c[key] is not None]).text()


def report(doc: dict) -> str:
    lines = ["| neighbour | rows x length | threads | served ms | shadow wall / served | "
             "shadow cost / served |", "|---|---|---|---|---|---|"]
    best = ["| neighbour | rows x length | fastest served | fastest by shadow cost |",
            "|---|---|---|---|"]
    for name in NEIGHBOURS:
        for rows, length in SHAPES:
            medians = {}
            for n in COUNTS:
                cs = [c for c in doc["cells"] if (c["neighbour"], c["rows"], c["length"],
                                                  c["threads"]) == (name, rows, length, n)]
                served = statistics.median(c["served_ms"] for c in cs)
                costs = [c["shadow_cost_ms"] for c in cs if c["shadow_cost_ms"] is not None]
                medians[n] = (served, statistics.median(costs) if costs else math.inf)
                lines.append(f"| {name} | {rows}x{length} | {n} | {served:.1f} | "
                             f"{_ratio(cs, 'shadow_wall_ms')} | {_ratio(cs, 'shadow_cost_ms')} |")
            best.append(f"| {name} | {rows}x{length} | "
                        f"{min(COUNTS, key=lambda k: medians[k][0])} | "
                        f"{min(COUNTS, key=lambda k: medians[k][1])} |")
    return "\n".join(lines + [""] + best)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shadow_vs_served")
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/shadow_vs_served.json")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.reps < 1:
        raise SystemExit("--rounds must be >= 2 (an interval needs two) and --reps >= 1")
    doc = run(args.model, args.backend, args.rounds, args.reps, args.seed)
    doc["report"] = report(doc)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(doc["report"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
