"""int8 recipes side by side: quality against float32 and forward speed against onnxruntime
float32, in one run. ``python -m bench.int8_sweep [--models all-MiniLM-L6-v2]
[--recipes NAME,...] [--rounds 10] [--threads 1] [--shapes 1x16,...] [--out FILE]``.

Per model, every recipe of ``runtime/quantization.py`` quantizes the runtime's ONNX export;
its quality is the gate's own figure (minimum cosine of the pooled embeddings to onnxruntime
float32's over the 32 evaluation texts, batched as the gate batches them). Speed: each round
runs, per shape, float32 and every recipe back to back in a shuffled order on rows of real
text (``bench.precision.text_batch``); a recipe's speed-up in a round is float32's time over
its own in that round (paired), summarised by the median with a bootstrap 95% interval. The
load average before and after is recorded: on a shared host the intervals are what to read.
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

from bench.precision import bootstrap_median, host, parse_shape, text_batch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import OnnxBackend
from vllm_srun.runtime.export import ensure_onnx
from vllm_srun.runtime.quality import figures, gate_batches
from vllm_srun.runtime.quantization import DEFAULT, RECIPES, quantize
from vllm_srun.runtime.tokenizer import Tokenizer

SHAPES = ("1x16", "1x128", "8x64", "16x128")
GATE = 0.999  # the default quality_gate.min_cosine


def quality(manifest, backend: OnnxBackend, batches, reference) -> float:
    got = [backend.forward(b, 1).outputs for b in batches]
    return float(figures(manifest, batches, reference, got).min_cosine)


def sweep_model(model: str, recipes: list[str], shapes: list, rounds: int, threads: int,
                folder: Path) -> dict:
    manifest = resolve(model)
    source = ensure_onnx(manifest)
    base = OnnxBackend(manifest, str(source))
    batches = gate_batches(manifest, Tokenizer(manifest.tokenizer_path, manifest.max_tokens))
    reference = [base.forward(b, 1).outputs for b in batches]
    backends, out = {"float32": base}, {}
    for name in recipes:
        target = folder / f"{manifest.revision}-{name}.onnx"
        kernels = quantize(source, target, RECIPES[name])
        backends[name] = OnnxBackend(manifest, str(target))
        out[name] = {"min_cosine": quality(manifest, backends[name], batches, reference),
                     "kernels": {k: list(kernels.values()).count(k)
                                 for k in sorted(set(kernels.values()))},
                     "size_mb": round(target.stat().st_size / 2**20, 1)}
        print(f"{model} {name}: min cosine {out[name]['min_cosine']:.6f}", flush=True)
    texts = {s.name: text_batch(s, manifest.tokenizer_path) for s in shapes}
    ms = {c: {s.name: [] for s in shapes} for c in backends}
    order = list(backends)
    for b in backends.values():  # warm each session at this count
        b.forward(texts[shapes[0].name], threads)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for s in shapes:
            for c in order:
                ms[c][s.name].append(1000 * backends[c].forward(texts[s.name], threads).forward_s)
        print(f"{model} round {r + 1}/{rounds}; load {os.getloadavg()[0]:.2f}", flush=True)
    for name in recipes:
        speed = {}
        for s in shapes:
            ratios = [a / b for a, b in zip(ms["float32"][s.name], ms[name][s.name],
                                            strict=True)]
            med, lo, hi = bootstrap_median(ratios)
            speed[s.name] = {"speedup": med, "ci95": [lo, hi],
                             "median_ms": float(np.median(ms[name][s.name])),
                             "float32_median_ms": float(np.median(ms["float32"][s.name]))}
        out[name]["speed"] = speed
    return {"recipes": out, "ms": ms}


def table(model: str, result: dict) -> list[str]:
    recipes = result["recipes"]
    shapes = list(next(iter(recipes.values()))["speed"])
    head = " | ".join(f"{s} speed-up [95% CI]" for s in shapes)
    lines = [f"{model}:", f"| recipe | min cosine | gate 0.999 | {head} |",
             "|---|---|---|" + "---|" * len(shapes)]
    for name, r in recipes.items():
        cells = " | ".join(f"{v['speedup']:.2f} [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]"
                           for v in r["speed"].values())
        ok = "passes" if r["min_cosine"] >= GATE else "refused"
        lines.append(f"| {name} | {r['min_cosine']:.5f} | {ok} | {cells} |")
    return lines


def choice(result: dict) -> str | None:
    """The recipe to default to: among those that pass the gate, the fastest by the geometric
    mean of its median speed-ups; None when none passes."""
    passed = {n: r for n, r in result["recipes"].items() if r["min_cosine"] >= GATE}
    if not passed:
        return None
    return max(passed, key=lambda n: float(np.exp(np.mean(
        [np.log(v["speedup"]) for v in passed[n]["speed"].values()]))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8_sweep")
    parser.add_argument("--models", default="all-MiniLM-L6-v2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default="bench/results/int8_sweep.json")
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or args.rounds < 2 or args.threads < 1:
        raise SystemExit(f"--recipes: unknown {unknown} (known: {', '.join(RECIPES)}); "
                         "--rounds >= 2; --threads >= 1")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    before, t0 = host(), time.perf_counter()
    print(f"{before['cpu']} ({before['cpus']} CPUs); {before['uptime']}", flush=True)
    models, lines = {}, []
    with tempfile.TemporaryDirectory(prefix="int8-sweep-") as tmp:
        for model in args.models.split(","):
            models[model] = sweep_model(model, recipes, shapes, args.rounds, args.threads,
                                        Path(tmp))
            best = choice(models[model])
            lines += [*table(model, models[model]),
                      f"fastest that passes the gate: {best or 'none'}; runtime default: "
                      f"{DEFAULT.name}", ""]
    after = host()
    lines.insert(0, f"{args.rounds} interleaved rounds at {args.threads} thread(s) in "
                    f"{time.perf_counter() - t0:.0f} s; before: {before['uptime']}; after: "
                    f"{after['uptime']}")
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({
        "host_before": before, "host_after": after, "threads": args.threads,
        "rounds": args.rounds, "gate_min_cosine": GATE, "default": DEFAULT.name,
        "models": models, "report": lines}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
