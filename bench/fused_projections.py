"""torch bfloat16 forwards with an attention's query, key and value projections as one packed
product (``runtime/torch_fast.py``) against the three on their own, side by side in one
process. ``python -m bench.fused_projections [--model M] [--rounds 11] [--threads 1]
[--shapes 1x8,...] [--out FILE]``.

Both modules are built as the torch backend builds them (packed, traced, frozen); the other
one with the fusion turned off. Each round times, per shape, both back to back in alternating
order; a round's ratio is fused over apart. Printed per shape: the median ratio over rounds
with a bootstrap 95% interval, and whether the answers were bit for bit the same.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.precision import bootstrap_median, host, parse_shape
from vllm_srun.runtime import torch_fast
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.types import TokenBatch

SHAPES = ("1x8", "1x32", "4x32", "8x32", "16x64", "32x16")


def backends(model: str):
    manifest = resolve(model)
    fused = load_backend(manifest, "torch", precision="bfloat16")
    saved = torch_fast.PROJECTIONS
    torch_fast.PROJECTIONS = ("none", "such", "names")  # nothing to fuse
    try:
        apart = load_backend(manifest, "torch", precision="bfloat16")
    finally:
        torch_fast.PROJECTIONS = saved
    return fused, apart


def measure(fused, apart, shape, rounds: int, threads: int) -> dict:
    rows, tokens = shape.rows, shape.tokens
    ids = np.random.default_rng(rows * 1000 + tokens).integers(
        1000, 20000, (rows, tokens)).astype(np.int64)
    batch = TokenBatch(ids, np.ones_like(ids), np.zeros_like(ids), None)
    same = bool(np.array_equal(fused.forward(batch, threads).outputs,
                               apart.forward(batch, threads).outputs))
    reps = max(3, 120 // (rows * tokens // 8 + 1))
    ratios = []
    for r in range(rounds):
        took = {}
        order = (("fused", fused), ("apart", apart))
        for name, backend in order if r % 2 else order[::-1]:
            start = time.perf_counter()
            for _ in range(reps):
                backend.forward(batch, threads)
            took[name] = (time.perf_counter() - start) / reps
        ratios.append(took["fused"] / took["apart"])
    median, low, high = bootstrap_median(ratios)
    return {"rows": rows, "tokens": tokens, "threads": threads, "same_answers": same,
            "fused_over_apart": median, "ci95": [low, high], "rounds": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fused_projections", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    fused, apart = backends(args.model)
    lane = ThreadContext()
    try:
        results = []
        for text in args.shapes.split(","):
            shape = parse_shape(text)
            r = lane.run(args.threads, lambda s=shape: measure(fused, apart, s, args.rounds,
                                                               args.threads))
            results.append(r)
            print(f"{r['rows']}x{r['tokens']} at {args.threads} thread(s): fused / apart "
                  f"{r['fused_over_apart']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}], "
                  f"same answers: {r['same_answers']}", flush=True)
    finally:
        lane.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps({"host": host(), "model": args.model,
                                              "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
