"""The forward table the simulator's forward model is fitted to (``tuner/simulate``): forward ms of
all-MiniLM-L6-v2 per backend x precision x thread count x rows x padded length, on this host.
``python -m bench.forward_table [--rounds 6] [--max-tokens 2048] [--out FILE]`` (one command,
a few minutes on 2 vCPUs).

Configurations: torch float32, torch bfloat16 (the module's weights in bfloat16, as
``bench/precision.py`` loads it) and onnxruntime float32, each at 1 and 2 threads on the runtime's
thread lanes (``ThreadContext``). Shapes: rows {1, 4, 8, 16} x padded lengths {8, ..., 512},
those within ``--max-tokens`` padded tokens (a worker's ``max_num_batched_tokens``). Rows are
windows of real English text (``bench.precision.text_batch``), never random ids.

The host is shared, so load drift must hit every configuration alike: every configuration and
count runs once on every shape before any runs twice (a round), shapes in a shuffled order per
round, and per shape the configurations and counts in an order that rotates. After a warm-up
pass, a cell's figure is the median over rounds with its interquartile range. The load average
(``os.getloadavg``) is sampled after every round and stored, with the CPU's model name. At the
end it prints the simulator's fit (``tuner/sim_model.py``) to the new table: the worst cell per
configuration, which tests/test_simulate.py holds within 15% once the table was measured on a
quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.precision import MODEL, Shape, forward, host, load_configs, text_batch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.tuner.sim_model import errors, fit_table

CONFIGS = ("torch-float32", "torch-bfloat16", "onnxruntime-float32")
ROWS = (1, 4, 8, 16)
LENGTHS = (8, 16, 32, 64, 128, 256, 512)
COUNTS = (1, 2)


def shapes(max_tokens: int) -> list[Shape]:
    return [Shape(r, t) for r in ROWS for t in LENGTHS if r * t <= max_tokens]


def measure(backends: dict, grid: list[Shape], rounds: int, tokenizer_path: str) -> dict:
    """Per config, shape and count the forward ms of every round; the load average after
    each round (1-minute figure)."""
    context = ThreadContext()
    batches = {s.name: text_batch(s, tokenizer_path) for s in grid}
    ms = {c: {s.name: {n: [] for n in COUNTS} for s in grid} for c in backends}
    lanes = [(c, n) for c in backends for n in COUNTS]
    load = []
    try:
        for s in grid:  # warm-up: every shape once per config and count, not kept
            for c, n in lanes:
                forward(context, backends[c], batches[s.name], n)
        for r in range(rounds):
            order = list(grid)
            random.Random(r).shuffle(order)
            for i, s in enumerate(order):
                k = (r + i) % len(lanes)
                for c, n in lanes[k:] + lanes[:k]:
                    res = forward(context, backends[c], batches[s.name], n)
                    ms[c][s.name][n].append(1000 * res.forward_s)
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}/{rounds}; load {load[-1]:.2f}", flush=True)
    finally:
        context.shutdown()
    return {"ms": ms, "load_1min_per_round": load}


def cells(ms: dict) -> list[dict]:
    out = []
    for c, per_shape in ms.items():
        backend, precision = c.split("-")
        for name, per_count in per_shape.items():
            rows, tokens = (int(x) for x in name.split("x"))
            for n, v in per_count.items():
                q1, med, q3 = np.percentile(v, [25, 50, 75])
                out.append({"backend": backend, "precision": precision, "rows": rows,
                            "padded_tokens": tokens, "threads": int(n),
                            "median_ms": round(float(med), 3),
                            "iqr_ms": round(float(q3 - q1), 3), "p25_ms": round(float(q1), 3),
                            "min_ms": round(float(min(v)), 3), "repeats": len(v)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.forward_table")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="bench/results/forward_table.json")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        raise SystemExit("--rounds must be >= 3 (a median and an IQR)")
    if args.max_tokens < 8:
        raise SystemExit("--max-tokens must be >= 8")
    grid = shapes(args.max_tokens)
    before = host()
    print(f"{before['cpu']} ({before['cpus']} CPUs); {before['uptime']}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="forward-table-") as tmp:
        backends = load_configs(args.configs.split(","), Path(tmp))
        data = measure(backends, grid, args.rounds, resolve(MODEL).tokenizer_path)
    after = host()
    load = data["load_1min_per_round"]
    doc = {"model": MODEL, "cpu": before["cpu"], "cpus": before["cpus"], "amx": before["amx"],
           "utc": before["utc"], "seconds": round(time.perf_counter() - t0, 1),
           "rounds": args.rounds, "max_tokens": args.max_tokens,
           "load": {"before": before["uptime"], "after": after["uptime"],
                    "per_round_1min": [round(x, 2) for x in load],
                    "note": f"1-minute load average {min(load):.2f}-{max(load):.2f} on "
                            f"{before['cpus']} CPUs during the run (other tasks share the "
                            "host)"},
           "statistic": "median_ms: median over rounds after one warm-up pass; iqr_ms = p75 - "
                        "p25; p25_ms and min_ms beside them",
           "cells": cells(data["ms"]), "ms": data["ms"]}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['cells'])} cells in {doc['seconds']:.0f} s; {doc['load']['note']}; "
          f"wrote {args.out}")
    for key, fit in fit_table(doc).items():  # what tests/test_simulate.py will check
        cell, err = max(errors(fit, doc["cells"]), key=lambda ce: abs(ce[1]))
        print(f"simulator fit {'/'.join(key)}: worst cell {cell['rows']}x"
              f"{cell['padded_tokens']} at {cell['threads']} thread(s), {err:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
