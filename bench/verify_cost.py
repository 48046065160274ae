"""Where the time of ``vllm-srun threads verify`` goes, in one process on this machine.

Times the default plan's forwards (all-MiniLM-L6-v2, onnxruntime, counts 1 and 2, the CLI's
default bounds) on every ``--every``-th shape, 1 thread and 2 threads back to back as the
sweep runs them, and extrapolates each padded-token range's share of the whole sweep. Also
times what the sweep does besides the forwards (making each batch, comparing the bits).

    python -m bench.verify_cost [--every 10] [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from vllm_srun.runtime.artifact import DEFAULT_MODEL, resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.calibrate import CPU_CAP
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.tuner.adaptive import output_bits
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, shape_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--backend", default="onnxruntime")
    args = ap.parse_args()
    manifest = resolve(DEFAULT_MODEL)
    plan = plan_sweep(ShapeBounds(32, manifest.max_tokens, CPU_CAP, 2))
    backend = load_backend(manifest, args.backend)
    context = ThreadContext()
    rng = np.random.default_rng(0)
    for n in (1, 2):  # warm each count
        context.run(n, lambda n=n: backend.forward(shape_batch((1, 16), rng), n))
    spent: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # lo -> s at 1, 2,
    other_s, began = 0.0, time.perf_counter()  # besides forwards; and shapes
    for i, shape in enumerate(plan.shapes):
        if i % args.every:
            continue
        t0 = time.perf_counter()
        batch = shape_batch(shape, rng)
        t1 = time.perf_counter()
        a = context.run(1, lambda b=batch: backend.forward(b, 1)).outputs
        t2 = time.perf_counter()
        b = context.run(2, lambda b=batch: backend.forward(b, 2)).outputs
        t3 = time.perf_counter()
        np.array_equal(output_bits(a), output_bits(b))
        t4 = time.perf_counter()
        lo = size_range(shape[0] * shape[1])[0]
        row = spent[lo]
        row[0] += t2 - t1
        row[1] += t3 - t2
        row[3] += 1
        other_s += (t1 - t0) + (t4 - t3)
    wall = time.perf_counter() - began
    context.shutdown()
    k = args.every
    total = sum(r[0] + r[1] for r in spent.values()) * k
    print(f"{len(plan.shapes)} shapes ({plan.sampled} sampled above "
          f"{plan.exhaustive_padded} padded tokens); timed every {k}th: {wall:.0f} s wall")
    print(f"{'range':>12} {'shapes':>7} {'1 thr s':>8} {'2 thr s':>8} {'share':>6}"
          f" {'ms/shape':>9}")
    for lo in sorted(spent):
        one, two, _, shapes = spent[lo]
        print(f"{f'{lo}-{2 * lo - 1}':>12} {shapes * k:>7} {one * k:>8.1f} {two * k:>8.1f} "
              f"{(one + two) * k / total:>6.1%} {(one + two) / shapes * 1000:>9.2f}")
    print(f"whole sweep, extrapolated: {total:.0f} s of forwards "
          f"({sum(r[0] for r in spent.values()) * k:.0f} s at 1 thread), "
          f"{other_s * k:.1f} s besides them")


if __name__ == "__main__":
    main()
