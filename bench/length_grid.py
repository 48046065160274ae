"""What the length grid a mode 2 worker pads to costs and saves, per grid step.

A mode 2 worker pads each forward's length up to a grid (``runtime.sizes.grid_length``: every
length up to 2**(shift+1), then multiples of the largest power of two not above 1/2**shift
of the length), so that a voucher has fewer shapes to verify one by one. For each shift
(and for no grid), this prints:

- the default sweep plan of all-MiniLM-L6-v2 (32 rows, 16,384 padded tokens, lengths up to
  256): shapes and padded tokens per count;
- the benchmarks' mix of bodies (``bench.adaptive_wrk.MIX``: 70% short queries, 25%
  passages, 5% long, tokenized as the server does): distinct padded lengths of one-row
  forwards and the padded tokens added;
- the forward time that padding adds, measured: ``--rows`` bodies of the mix, one row a
  forward at 1 thread on onnxruntime, every shift in turn within a round (the order rotated
  each round), ``--rounds`` rounds; the ratio of each shift's summed forward time to no
  grid's, per round, with its median and bootstrap interval.

    python -m bench.length_grid [--rounds 10] [--rows 300]
                                [--out bench/results/length_grid.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from bench.adaptive_wrk import LUA, MIX
from bench.precision import host
from bench.stats import median_interval
from vllm_srun.runtime.artifact import DEFAULT_MODEL, resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.sizes import GRID_SHIFT, grid_length, on_grid
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep

SHIFTS = (2, 3, 4)  # steps of at most 1/4, 1/8, 1/16 of the length
WORDS = re.findall(r'"(\w+)"', LUA.split("local words = {", 1)[1].split("}", 1)[0])


def mix_bodies(n: int, seed: int = 0) -> list[str]:
    """Bodies as ``bench.adaptive_wrk``'s script makes them: a unique prefix, then the
    mix's number of words drawn at random."""
    rng = random.Random(seed)
    classes = [(share, words) for _, share, words in MIX]
    out = []
    for i in range(n):
        u, words = rng.random(), classes[-1][1]
        for share, w in classes:
            if u < share:
                words = w
                break
            u -= share
        out.append(f"t1r{i}s{rng.randrange(1_000_000)} "
                   + " ".join(rng.choice(WORDS) for _ in range(words)))
    return out


@dataclass(frozen=True)
class GridBounds(ShapeBounds):
    """A sweep's bounds on the grid of ``shift`` (``ShapeBounds`` knows the product's)."""

    shift: int | None = None

    def shapes(self) -> list[tuple[int, int]]:
        every = ShapeBounds(self.max_rows, self.max_len, self.max_padded, self.min_len,
                            grid=False).shapes()
        return [s for s in every if self.shift is None
                or on_grid(s[1], self.max_len, self.shift)]


def plan_figures(shift: int | None, max_len: int) -> dict:
    shapes = plan_sweep(GridBounds(32, max_len, 16384, grid=False, shift=shift)).shapes
    return {"shapes": len(shapes), "padded_tokens_per_count": sum(r * n for r, n in shapes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.length_grid")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "length_grid.json"))
    args = p.parse_args(argv)
    manifest = resolve(DEFAULT_MODEL)
    tokenizer = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
    max_len = manifest.max_tokens
    rows = tokenizer.encode(mix_bodies(2000), truncate=True)
    lengths = [len(r) for r in rows]
    figures: dict[str, dict] = {}
    for shift in (None, *SHIFTS):
        padded = lengths if shift is None else [grid_length(n, max_len, shift) for n in lengths]
        figures[str(shift)] = {
            **plan_figures(shift, max_len),
            "mix_distinct_lengths": len(set(padded)),
            "mix_padded_tokens_added": sum(padded) / sum(lengths) - 1}
    backend = load_backend(manifest, "onnxruntime")
    context = ThreadContext()
    timed = rows[: args.rows]
    batches = {str(s): [pad([r], to=None if s is None else
                             (lambda n, s=s: grid_length(n, max_len, s))) for r in timed]
               for s in (None, *SHIFTS)}
    for b in batches["None"][:20]:  # warm
        context.run(1, lambda b=b: backend.forward(b, 1))
    seconds: dict[str, list[float]] = {k: [] for k in batches}
    keys = list(batches)
    for i in range(args.rounds):
        for k in keys[i % len(keys):] + keys[: i % len(keys)]:
            start = time.perf_counter()
            for b in batches[k]:
                context.run(1, lambda b=b: backend.forward(b, 1))
            seconds[k].append(time.perf_counter() - start)
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()),
              flush=True)
    context.shutdown()
    backend.close()
    for k in keys:
        ratio = median_interval([a / b for a, b in zip(seconds[k], seconds["None"],
                                                       strict=True)])
        figures[k]["forward_time_over_no_grid"] = [ratio.estimate, ratio.lo, ratio.hi]
    out = {"host": host(), "args": vars(args), "model": DEFAULT_MODEL, "grid_shift": GRID_SHIFT,
           "figures": figures, "seconds": seconds}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'grid':>8} {'sweep shapes':>12} {'tokens/count':>12} {'mix lengths':>11} "
          f"{'tokens added':>12} {'forward time':>24}")
    for k, f in figures.items():
        name = "none" if k == "None" else f"1/{2 ** int(k)}"
        est, lo, hi = f["forward_time_over_no_grid"]
        print(f"{name:>8} {f['shapes']:>12} {f['padded_tokens_per_count']:>12} "
              f"{f['mix_distinct_lengths']:>11} {f['mix_padded_tokens_added']:>12.3f} "
              f"{est:>8.3f} [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
