"""Does a precision answer finite values on this host, at every thread count?
``python -m bench.precision_finite [--configs onnxruntime-int8,...] [--counts 1,2,4,8,16]``.

Per configuration of ``bench.precision``, shape and count: how many rows of a batch of real
text hold a NaN or an infinity; then the quality gate (``selection.choose``) at the first, the
second and the last count. On a 16-core Xeon with AMX, onnxruntime 1.30's int8 copy answered
NaN on every row at every count, which the gate passed until it counted non-finite answers
(``bench/results/xeon16_host.txt``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.precision import MODEL, Shape, forward, load_configs, text_batch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.quality import GateThresholds, non_finite_rows
from vllm_srun.runtime.selection import choose
from vllm_srun.runtime.threads import ThreadContext

SHAPES = ("1x8", "1x128", "4x64", "8x256")
GATED = {"torch-bfloat16": ("torch", "bfloat16"), "onnxruntime-int8": ("onnxruntime", "int8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_finite")
    parser.add_argument("--configs", default="onnxruntime-int8")
    parser.add_argument("--counts", default="1,2,4,8,16")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    manifest = resolve(MODEL)
    import onnxruntime
    import torch

    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}", flush=True)
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            backend = load_configs([name], Path(tmp))[name]
            context = ThreadContext()
            try:
                for shape in SHAPES:
                    rows, tokens = map(int, shape.split("x"))
                    batch = text_batch(Shape(rows, tokens), manifest.tokenizer_path)
                    cells = []
                    for n in counts:
                        bad = non_finite_rows(batch, forward(context, backend, batch,
                                                             n).outputs)
                        cells.append(f"{n} threads {bad}/{rows}")
                    print(f"{name} {shape}: rows not finite: {', '.join(cells)}", flush=True)
            finally:
                context.shutdown()
                backend.close()
        if name not in GATED:
            continue
        backend_name, precision = GATED[name]
        for n in sorted({counts[0], counts[min(1, len(counts) - 1)], counts[-1]}):
            served, choice = choose(manifest, backend_name, precision, GateThresholds(), n,
                                    lambda p, b=backend_name: load_backend(manifest, b,
                                                                           precision=p))
            served.close()
            print(f"{name}: the gate at {n} threads: {choice.refusal or 'passed'} "
                  f"{choice.measured}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
