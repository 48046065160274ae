"""The forward table the simulator's forward model is fitted to (``tuner/simulate``): forward ms of
all-MiniLM-L6-v2 per backend x precision x thread count x rows x padded length, on this host.
``python -m bench.forward_table [--rounds 6] [--repeats 3] [--max-tokens 2048] [--out FILE]``
(one command, several minutes on 2 vCPUs); ``--compare A B`` sets two tables side by side.

Configurations: torch float32, torch bfloat16 (the module's weights in bfloat16, as
``bench/precision.py`` loads it) and onnxruntime float32, each at 1 and 2 threads on the runtime's
thread lanes (``ThreadContext``). Shapes: rows {1, 4, 8, 16} x padded lengths {8, ..., 512},
those within ``--max-tokens`` padded tokens (a worker's ``max_num_batched_tokens``). Rows are
windows of real English text (``bench.precision.text_batch``), never random ids.

The host is shared, so load drift must hit every configuration alike: every configuration and
count runs on every shape before any runs again (a round), shapes in a shuffled order per
round, and per shape the configurations and counts in an order that rotates. Per round a cell
runs up to ``--repeats`` timed forwards back to back (fewer once they took
``REPEAT_BUDGET_MS``): the first follows another configuration (its spinning pool, its
caches), the others follow their own.

The statistic the simulator is fitted to is ``min_ms``, the fastest forward of the cell: load
only ever adds time to a forward (a neighbour preempts one of a team's threads and its
barriers wait), so the fastest of many interleaved tries estimates the forward's own cost,
where the median estimates the cost under the load of that run (two runs of the old
median-based table an hour apart disagreed by up to 2x at 2 threads). The median, IQR and p25
stay beside it. After every round the bench records the 1-minute load average and, from
``/proc/stat``, the CPUs' worth of time that other processes used (the load average counts
the bench's own 1-2 busy threads; this does not) and the hypervisor's steal. At the end it
prints the simulator's fit (``tuner/sim_model.py``) to the new table: the worst cell per
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.precision import MODEL, Shape, forward, host, load_configs, text_batch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.tuner.sim_model import errors, fit_table, load_table, loaded

CONFIGS = ("torch-float32", "torch-bfloat16", "onnxruntime-float32")
ROWS = (1, 4, 8, 16)
LENGTHS = (8, 16, 32, 64, 128, 256, 512)
COUNTS = (1, 2)
# A cell stops repeating within a round once its timed forwards took this long: short cells
# get several tries per round, the longest (0.3-0.9 s) one, so a round takes about 1.5x the
# old bench's (one try per cell).
REPEAT_BUDGET_MS = 100.0
FITTED = "min_ms"  # the cell statistic tuner/sim_model.py fits (see the module doc)


def shapes(max_tokens: int) -> list[Shape]:
    return [Shape(r, t) for r in ROWS for t in LENGTHS if r * t <= max_tokens]


@dataclass(frozen=True)
class CpuTimes:
    """Host-wide busy and steal seconds (``/proc/stat``) and this process's CPU seconds."""

    busy_s: float
    steal_s: float
    own_s: float
    wall_s: float

    @staticmethod
    def now() -> CpuTimes:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        user, nice, system, _, _, irq, softirq, steal = (int(x) for x in fields[:8])
        hz = os.sysconf("SC_CLK_TCK")
        own = os.times()
        return CpuTimes((user + nice + system + irq + softirq) / hz, steal / hz,
                        own.user + own.system, time.monotonic())

    def others_since(self, before: CpuTimes) -> tuple[float, float]:
        """(CPUs' worth used by other processes, CPUs' worth stolen) since ``before``."""
        wall = max(self.wall_s - before.wall_s, 1e-9)
        others = (self.busy_s - before.busy_s) - (self.own_s - before.own_s)
        return max(0.0, others / wall), (self.steal_s - before.steal_s) / wall


def measure(backends: dict, grid: list[Shape], rounds: int, repeats: int,
            tokenizer_path: str) -> dict:
    """Per config, shape and count the timed forward ms of every round (a list per round);
    per round the 1-minute load average, other processes' CPUs and steal."""
    context = ThreadContext()
    batches = {s.name: text_batch(s, tokenizer_path) for s in grid}
    ms = {c: {s.name: {n: [] for n in COUNTS} for s in grid} for c in backends}
    lanes = [(c, n) for c in backends for n in COUNTS]
    load, others, steal = [], [], []
    try:
        for s in grid:  # warm-up: every shape once per config and count, not kept
            for c, n in lanes:
                forward(context, backends[c], batches[s.name], n)
        for r in range(rounds):
            start = CpuTimes.now()
            order = list(grid)
            random.Random(r).shuffle(order)
            for i, s in enumerate(order):
                k = (r + i) % len(lanes)
                for c, n in lanes[k:] + lanes[:k]:
                    ms[c][s.name][n].append(tries(context, backends[c], batches[s.name], n,
                                                  repeats))
            other, stolen = CpuTimes.now().others_since(start)
            load.append(os.getloadavg()[0])
            others.append(other)
            steal.append(stolen)
            print(f"round {r + 1}/{rounds}; load {load[-1]:.2f}, other processes "
                  f"{other:.2f} CPUs, steal {stolen:.2f}", flush=True)
    finally:
        context.shutdown()
    return {"ms": ms, "load_1min_per_round": load, "others_cpus_per_round": others,
            "steal_cpus_per_round": steal}


def tries(context: ThreadContext, backend, batch, n: int, repeats: int) -> list[float]:
    """Up to ``repeats`` timed forwards (ms) back to back, fewer once they took the budget."""
    out: list[float] = []
    while len(out) < repeats and sum(out) < REPEAT_BUDGET_MS:
        out.append(round(1000 * forward(context, backend, batch, n).forward_s, 3))
    return out


def cells(ms: dict) -> list[dict]:
    """One row per config, shape and count: ``min_ms`` (fitted) over every timed forward, and
    the median, p25 and IQR of each round's fastest."""
    out = []
    for c, per_shape in ms.items():
        backend, precision = c.split("-")
        for name, per_count in per_shape.items():
            rows, tokens = (int(x) for x in name.split("x"))
            for n, per_round in per_count.items():
                best = [min(v) for v in per_round]
                q1, med, q3 = np.percentile(best, [25, 50, 75])
                out.append({"backend": backend, "precision": precision, "rows": rows,
                            "padded_tokens": tokens, "threads": int(n),
                            "min_ms": round(float(min(best)), 3),
                            "median_ms": round(float(med), 3), "p25_ms": round(float(q1), 3),
                            "iqr_ms": round(float(q3 - q1), 3), "rounds": len(per_round),
                            "repeats": sum(len(v) for v in per_round)})
    return out


def load_note(data: dict, cpus: int) -> dict:
    load, others = data["load_1min_per_round"], data["others_cpus_per_round"]
    steal = data["steal_cpus_per_round"]
    return {"per_round_1min": [round(x, 2) for x in load],
            "others_cpus_per_round": [round(x, 2) for x in others],
            "steal_cpus_per_round": [round(x, 3) for x in steal],
            "note": f"1-minute load average {min(load):.2f}-{max(load):.2f} on {cpus} CPUs "
                    f"during the run, of which other processes used {min(others):.2f}-"
                    f"{max(others):.2f} CPUs per round (other tasks share the host)"}


def compare(a: dict, b: dict) -> list[str]:
    """Two tables (``load_table``) side by side: per configuration and count, the spread of
    ``b / a`` over cells of the fitted statistic, then each table's fit checked on the other
    (cross-validation): is a difference the host's or the model's?"""
    def key(c: dict) -> tuple:
        return c["backend"], c["precision"], c["threads"], c["rows"], c["padded_tokens"]

    in_a = {key(c): c["fit_ms"] for c in a["cells"]}
    ratios: dict[tuple, list[tuple[float, str]]] = {}
    for c in b["cells"]:
        if key(c) in in_a:
            ratios.setdefault(key(c)[:3], []).append(
                (c["fit_ms"] / in_a[key(c)], f"{c['rows']}x{c['padded_tokens']}"))
    out = []
    for (backend, precision, n), rs in sorted(ratios.items()):
        values = np.asarray([r for r, _ in rs])
        worst = max(rs, key=lambda r: abs(np.log(r[0])))
        out.append(f"{backend}/{precision} {n} thread(s): b/a geometric mean "
                   f"{np.exp(np.log(values).mean()):.3f}, {values.min():.3f}-{values.max():.3f}"
                   f", furthest {worst[1]} {worst[0]:.3f} ({len(rs)} cells)")
    for name, fit_on, other, check in (("a", a, "b", b), ("b", b, "a", a)):
        for (backend, precision), fit in fit_table(fit_on).items():
            for label, doc in ((name, fit_on), (other, check)):
                cell, err = max(errors(fit, doc["cells"]), key=lambda ce: abs(ce[1]))
                out.append(f"fit on {name} {backend}/{precision}, checked on {label}: worst "
                           f"{cell['rows']}x{cell['padded_tokens']} at {cell['threads']} "
                           f"thread(s) {err:+.1%}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.forward_table")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="bench/results/forward_table.json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="compare two tables (cell by cell and fit on one, checked on the "
                             "other) and measure nothing")
    args = parser.parse_args(argv)
    if args.compare:
        print("\n".join(compare(*(load_table(p) for p in args.compare))))
        return 0
    if args.rounds < 3:
        raise SystemExit("--rounds must be >= 3 (a median and an IQR)")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.max_tokens < 8:
        raise SystemExit("--max-tokens must be >= 8")
    grid = shapes(args.max_tokens)
    before = host()
    print(f"{before['cpu']} ({before['cpus']} CPUs); {before['uptime']}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="forward-table-") as tmp:
        backends = load_configs(args.configs.split(","), Path(tmp))
        data = measure(backends, grid, args.rounds, args.repeats,
                       resolve(MODEL).tokenizer_path)
    after = host()
    doc = {"model": MODEL, "cpu": before["cpu"], "cpus": before["cpus"], "amx": before["amx"],
           "utc": before["utc"], "seconds": round(time.perf_counter() - t0, 1),
           "rounds": args.rounds, "repeats": args.repeats, "max_tokens": args.max_tokens,
           "load": {"before": before["uptime"], "after": after["uptime"],
                    **load_note(data, before["cpus"])},
           "fitted": FITTED,
           "statistic": "min_ms (fitted): the fastest timed forward over all rounds; per round "
                        "a cell runs up to `repeats` timed forwards back to back, fewer once "
                        f"they took {REPEAT_BUDGET_MS:.0f} ms; median_ms, p25_ms, iqr_ms: over "
                        "rounds of each round's fastest",
           "cells": cells(data["ms"]), "ms": data["ms"]}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['cells'])} cells in {doc['seconds']:.0f} s; {doc['load']['note']}; "
          f"wrote {args.out}")
    table = load_table(args.out)
    why = loaded(table)
    print(f"not calibration-grade: measured {why}" if why else "calibration-grade (quiet)")
    for key, fit in fit_table(table).items():  # what tests/test_simulate.py will check
        cell, err = max(errors(fit, table["cells"]), key=lambda ce: abs(ce[1]))
        print(f"simulator fit {'/'.join(key)}: worst cell {cell['rows']}x"
              f"{cell['padded_tokens']} at {cell['threads']} thread(s), {err:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
