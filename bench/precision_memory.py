"""Resident memory of a torch worker per precision: ``python -m bench.precision_memory
[--models l6,modernbert-base] [--dtypes float32,bfloat16] [--out FILE]``.

Each (model, precision) runs in a fresh process that does what a worker does: it loads the
backend through the quality gate (``selection.choose``: float32 answers the gate's texts,
then the precision that serves is loaded and gated, and what does not serve is released),
then serves forwards of several shapes at one thread. ``/proc/self/smaps_rollup`` is read
after the imports and the model's code (its class built on the meta device: no weights) and
again after serving; the model's memory is the difference. A last reading after 32 more
input lengths (8 to 256 tokens) shows what grows with the number of distinct shapes served:
torch's bfloat16 matrix products go through oneDNN, which compiles and caches kernels per
shape (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` bounds its cache); float32's go through MKL.
RSS counts file pages too: float32 weights are read from the memory-mapped safetensors
file (pages shared with every process that maps it, which PSS divides among them), bfloat16
ones are converted copies in anonymous memory.

Models: all-MiniLM-L6-v2 (22.7M parameters) and a ModernBERT-base-shaped encoder (149M,
random weights, built here like ``bench.long_inputs``): memory does not depend on the
weights' values, and no base-size model with trained weights installs offline here. The
gate's threshold is set to 0 for this measurement (the random model's figures mean
nothing); the gate still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.precision import host

MODELS = ("l6", "modernbert-base")
DTYPES = ("float32", "bfloat16")
SHAPES = ((1, 16), (8, 64), (4, 256), (1, 512))
FIELDS = ("Rss", "Pss", "Anonymous", "Shared_Clean", "Private_Clean")


def smaps_mb() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB" and parts[0].rstrip(":") in FIELDS:
            out[parts[0].rstrip(":")] = round(int(parts[1]) / 1024, 1)
    return out


def child(folder: str, dtype: str) -> dict:
    """One worker's figures (runs in the fresh process)."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModel

    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.quality import GateThresholds
    from vllm_srun.runtime.selection import choose
    from vllm_srun.runtime.threads import ThreadContext

    manifest = resolve(folder)
    with torch.device("meta"):  # the model's code imported, no weights
        AutoModel.from_config(AutoConfig.from_pretrained(manifest.path))
    baseline = smaps_mb()
    backend, choice = choose(manifest, "torch", dtype, GateThresholds(min_cosine=0.0), 1,
                             lambda p: load_backend(manifest, "torch", precision=p))
    context = ThreadContext()
    rng = np.random.default_rng(0)
    limit = manifest.max_tokens
    for rows, tokens in SHAPES:
        tokens = min(tokens, limit)
        batch = pad([[101, *map(int, rng.integers(1000, 29000, tokens - 2)), 102]
                     for _ in range(rows)])
        for _ in range(2):
            context.run(1, lambda b=batch: backend.forward(b, 1))
    served = smaps_mb()
    for tokens in range(8, min(256, limit) + 1, 8):  # new shapes: kernels cached per shape
        batch = pad([[101, *map(int, rng.integers(1000, 29000, tokens - 2)), 102]])
        context.run(1, lambda b=batch: backend.forward(b, 1))
    context.shutdown()
    many = smaps_mb()
    module = getattr(backend, "module", None)
    dtypes = sorted({str(t.dtype) for t in [*module.parameters(), *module.buffers()]
                     if t.is_floating_point()}) if module is not None else []
    weights_mb = sum(t.numel() * t.element_size() for t in module.parameters()) / 2**20
    return {"baseline_mb": baseline, "served_mb": served, "chosen": choice.precision.value,
            "floating_dtypes": dtypes, "weights_mb": round(weights_mb, 1),
            "model_rss_mb": round(served["Rss"] - baseline["Rss"], 1),
            "model_pss_mb": round(served["Pss"] - baseline["Pss"], 1),
            "model_anonymous_mb": round(served["Anonymous"] - baseline["Anonymous"], 1),
            "after_32_more_shapes_mb": many,
            "growth_over_32_shapes_mb": round(many["Rss"] - served["Rss"], 1)}


def model_folder(name: str, tmp: Path) -> str:
    if name == "l6":
        return "all-MiniLM-L6-v2"
    if name == "modernbert-base":
        from bench.long_inputs import build_model

        return str(build_model(tmp / "modernbert-base"))
    raise SystemExit(f"--models: {name!r} is not one of {', '.join(MODELS)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_memory")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--out", default="bench/results/precision_memory.json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    before, results, lines = host(), {}, []
    lines.append("| model | precision | worker RSS MB | PSS MB | model RSS MB | model anonymous "
                 "MB | weights MB | model RSS / float32's | RSS growth over 32 more shapes MB |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="precision-memory-") as tmp:
        for name in args.models.split(","):
            folder = model_folder(name, Path(tmp))
            results[name] = {}
            for dtype in args.dtypes.split(","):
                r = subprocess.run([sys.executable, "-m", "bench.precision_memory", "--child",
                                    folder, dtype], capture_output=True, text=True,
                                   env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
                if r.returncode != 0:
                    raise SystemExit(f"{name} {dtype} failed:\n{r.stderr[-3000:]}")
                got = results[name][dtype] = json.loads(r.stdout.strip().splitlines()[-1])
                base = results[name].get("float32", got)
                lines.append(f"| {name} | {dtype} | {got['served_mb']['Rss']} | "
                             f"{got['served_mb']['Pss']} | {got['model_rss_mb']} | "
                             f"{got['model_anonymous_mb']} | {got['weights_mb']} | "
                             f"{got['model_rss_mb'] / base['model_rss_mb']:.2f} | "
                             f"{got['growth_over_32_shapes_mb']} |")
                print(lines[-1], flush=True)
    after = host()
    lines.insert(0, f"before: {before['uptime']}; after: {after['uptime']}")
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({"host_before": before, "host_after": after,
                                          "shapes": SHAPES, "results": results,
                                          "report": lines}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
