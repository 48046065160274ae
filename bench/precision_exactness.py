"""Are a precision's answers bit-identical across thread counts, by shape?
``python -m bench.precision_exactness [--configs ...] [--rows 1-8] [--lengths ...] [--out FILE]``.

For every configuration of ``bench.precision`` (torch float32 / bfloat16, onnxruntime float32
/ int8) and every shape of the grid (rows x tokens of real text, every row exactly that
long, so no padding), the pooled answers at 1 thread, at 2 threads and at 1 thread again are
compared byte for byte. A shape *drifts* when 1 and 2 threads differ; the repeat at 1 thread
tells drift from a forward that is not even reproducible at one count.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.precision import CONFIGS, MODEL, Shape, host, load_configs, text_batch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.threads import ThreadContext

LENGTHS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def parse_ints(text: str) -> list[int]:
    """``1-8`` or ``1,2,5`` (or both) as a sorted list; each >= 1."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"not a list of integers: {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"integers must be >= 1: {text!r}")
    return sorted(out)


def compare(backend, context: ThreadContext, shapes: list[Shape], tokenizer_path: str,
            counts: tuple[int, int]) -> list[dict]:
    """One row per shape: identical or not across the counts, at a repeat, max difference."""
    lo, hi = counts
    out = []
    for s in shapes:
        batch = text_batch(s, tokenizer_path)
        a, b, a2 = (context.run(n, lambda n=n, batch=batch: backend.forward(batch, n)).outputs
                    for n in (lo, hi, lo))
        out.append({"rows": s.rows, "tokens": s.tokens,
                    "identical": a.tobytes() == b.tobytes(),
                    "repeat_identical": a.tobytes() == a2.tobytes(),
                    "max_abs_diff": float(np.abs(a.astype(np.float64) - b).max())})
    return out


def summary(config: str, rows: list[dict]) -> str:
    drift = [r for r in rows if not r["identical"]]
    unrepeatable = [r for r in rows if not r["repeat_identical"]]
    line = f"- {config}: {len(rows) - len(drift)} of {len(rows)} shapes bit-identical"
    if drift:
        by_rows: dict[int, list[int]] = {}
        for r in drift:
            by_rows.setdefault(r["rows"], []).append(r["tokens"])
        where = "; ".join(f"{k} row{'s' if k > 1 else ''}: tokens {v}"
                          for k, v in sorted(by_rows.items()))
        worst = max(r["max_abs_diff"] for r in drift)
        line += f"; drift at {where} (max |diff| {worst:.2g})"
    if unrepeatable:
        line += f"; {len(unrepeatable)} shapes not even repeatable at 1 thread"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_exactness")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rows", default="1-8")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--counts", default="1,2")
    parser.add_argument("--out", default="bench/results/precision_exactness.json")
    args = parser.parse_args(argv)
    counts = parse_ints(args.counts)
    if len(counts) != 2:
        raise SystemExit("--counts must name exactly two counts")
    shapes = [Shape(r, t) for r in parse_ints(args.rows) for t in parse_ints(args.lengths)]
    info = host()
    print(f"{info['cpu']} (AMX {info['amx']}); {info['uptime']}; {len(shapes)} shapes")
    results, lines = {}, []
    tokenizer_path = resolve(MODEL).tokenizer_path
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        for name in args.configs.split(","):
            backend = load_configs([name], Path(tmp))[name]
            context = ThreadContext()
            t0 = time.perf_counter()
            try:
                results[name] = compare(backend, context, shapes, tokenizer_path,
                                        (counts[0], counts[1]))
            finally:
                context.shutdown()
                backend.close()
            lines.append(summary(name, results[name]))
            print(f"{lines[-1]}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(  # after each config: a long run keeps some
                {"host": info, "counts": counts, "results": results, "report": lines}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
