"""Forward time per precision x thread count x input size, all-MiniLM-L6-v2 on real text:
``python -m bench.precision [--rounds 12] [--counts 1,2] [--shapes 1x8,...] [--out FILE]``.

Configurations (the runtime's own backends, on the thread context's lanes):
- torch float32: the runtime's torch backend as loaded today;
- torch bfloat16: the runtime's torch backend at ``--dtype bfloat16`` (weights loaded as
  bfloat16: each float32 weight rounded once);
- onnxruntime float32: the runtime's ONNX export;
- onnxruntime int8: the runtime's int8 copy (``--dtype int8``: the default recipe of
  ``runtime/quantization.py``, blockwise int8 MatMuls);
- onnxruntime int8-dynamic: the export through ``quantize_dynamic`` (per-channel int8
  weights, activations quantized per tensor and forward), the faster recipe that the default
  quality gate refuses for this model (``bench/int8_sweep.py``).

Inputs are rows of real English text (a fixed passage, each row a different window of its
tokens, exactly ``tokens`` per row with [CLS] and [SEP]), never random ids, so the quality
column (the lowest cosine of a row's pooled vector to torch float32's) means something.

The host is shared, so configurations are interleaved: each round runs every shape, and per
shape every configuration at every count back to back (the order rotates per round). A
cell's figure is the median over rounds (the best is kept too); the 2-thread speedup of a
round is its own 1-thread time over its 2-thread time for the same configuration and shape
(paired), summarised by the median with a 95% bootstrap interval. The best count per shape is
2 where the interval lies above 1, 1 where it lies below, else a tie.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import OnnxBackend, TorchBackend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.export import ensure_onnx
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.types import TokenBatch

MODEL = "all-MiniLM-L6-v2"
CONFIGS = ("torch-float32", "torch-bfloat16", "onnxruntime-float32", "onnxruntime-int8",
           "onnxruntime-int8-dynamic")
SHAPES = ("1x8", "1x32", "1x128", "1x256", "4x64", "16x64", "8x256", "32x128")
BOOTSTRAP = 2000  # resamples of the paired ratios; the interval's ends move < 1% beyond this

PASSAGE = """\
The river leaves the mountains through a narrow gorge and spreads across the plain in a slow
wide curve. Farmers along its banks have grown rice and barley there for more than a thousand
years, and the old irrigation channels still carry water to fields that the first settlers
cleared. In spring the snow melts quickly, the level rises by several metres in a week, and
the villages move their boats and livestock to higher ground until the flood has passed.
Scientists who study the basin measure the sediment the water carries, because the silt that
settles on the fields each year is what keeps the soil so fertile. A new dam upstream would
store water for the dry months and produce electricity for the growing city on the coast, but
it would also trap most of that sediment behind its wall. The engineers argue that fertiliser
could replace it; the farmers doubt that any bag of chemicals does what the river has always
done for free. Meanwhile the city keeps growing. Its port handles container ships from three
continents, its university attracts students from every province, and its restaurants serve
fish that was swimming in the estuary that morning. Housing is expensive, the trains are
crowded at rush hour, and the council has promised a second metro line that has been delayed
twice already. Still, most people who move there stay: the summers are warm, the markets are
lively, and on a clear evening the mountains are visible from the harbour, blue and distant,
with the first snow already on the highest peaks. How many people will the region support in
fifty years? Nobody knows, but the questions of water, energy and food will decide it, and
the river sits at the centre of all three."""


@dataclass(frozen=True)
class Shape:
    rows: int
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.rows}x{self.tokens}"


def parse_shape(text: str) -> Shape:
    try:
        rows, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not ROWSxTOKENS") from None
    if rows < 1 or tokens < 2:
        raise SystemExit(f"--shapes: {text!r} needs rows >= 1 and tokens >= 2")
    return Shape(rows, tokens)


def text_batch(shape: Shape, tokenizer_path: str) -> TokenBatch:
    """``shape.rows`` rows of exactly ``shape.tokens`` ids: [CLS], a window of the passage's
    tokens (row i starts 37*i tokens in, wrapping round), [SEP]. ``tokens`` 1 is [CLS] alone."""
    ids = _passage_ids(tokenizer_path)
    cls_id, sep_id, body = ids[0], ids[1], ids[2:]
    rows = []
    for i in range(shape.rows):
        if shape.tokens == 1:
            rows.append([cls_id])
            continue
        start = (37 * i) % len(body)
        window = [body[(start + k) % len(body)] for k in range(shape.tokens - 2)]
        rows.append([cls_id, *window, sep_id])
    return pad(rows)


_IDS: dict[str, list[int]] = {}


def _passage_ids(tokenizer_path: str) -> list[int]:
    """[CLS id, SEP id, *the passage's token ids] (no padding, no truncation)."""
    if tokenizer_path not in _IDS:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
        tok.no_padding()
        tok.no_truncation()
        body = tok.encode(" ".join(PASSAGE.split()), add_special_tokens=False).ids
        _IDS[tokenizer_path] = [tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"), *body]
    return _IDS[tokenizer_path]


def quantized_onnx(src: Path, folder: Path, recipe: str) -> Path:
    """``src`` through ``runtime/quantization.py``'s ``recipe``, written into ``folder``."""
    from vllm_srun.runtime.quantization import RECIPES, quantize

    target = folder / f"{src.stem}-{recipe}.onnx"
    quantize(src, target, RECIPES[recipe])
    return target


def load_configs(names: list[str], folder: Path) -> dict:
    """Each configuration's backend (see the module doc)."""
    from vllm_srun.runtime.backend import load_backend

    manifest = resolve(MODEL)
    out = {}
    for name in names:
        if name == "torch-float32":
            out[name] = TorchBackend(manifest)
        elif name == "torch-bfloat16":
            out[name] = load_backend(manifest, "torch", precision="bfloat16")
        elif name == "onnxruntime-float32":
            out[name] = OnnxBackend(manifest, str(ensure_onnx(manifest)))
        elif name == "onnxruntime-int8":
            out[name] = load_backend(manifest, "onnxruntime", precision="int8")
        elif name == "onnxruntime-int8-dynamic":
            path = quantized_onnx(ensure_onnx(manifest), folder, "dynamic-embeddings")
            out[name] = OnnxBackend(manifest, str(path))
        else:
            raise SystemExit(f"--configs: {name!r} is not one of {', '.join(CONFIGS)}")
    return out


def forward(context: ThreadContext, backend, batch: TokenBatch, n: int):
    return context.run(n, lambda: backend.forward(batch, n))


def bootstrap_median(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median and a 95% percentile-bootstrap interval of it."""
    arr = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(arr, size=(BOOTSTRAP, len(arr)), replace=True), axis=1)
    return float(np.median(arr)), float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def measure(backends: dict, shapes: list[Shape], counts: list[int], rounds: int,
            tokenizer_path: str) -> dict:
    """Per (config, shape, count) the forward ms of every round, plus each config's lowest
    cosine to torch float32 per shape (first round's answers)."""
    context = ThreadContext()
    batches = {s.name: text_batch(s, tokenizer_path) for s in shapes}
    ms: dict[str, dict[str, dict[int, list[float]]]] = {
        c: {s.name: {n: [] for n in counts} for s in shapes} for c in backends}
    cosine: dict[str, dict[str, float]] = {c: {} for c in backends}
    order = list(backends)
    try:
        for b in backends.values():  # warm every lane and session once
            for n in counts:
                forward(context, b, batches[shapes[0].name], n)
        for r in range(rounds):
            random.Random(r).shuffle(order)
            for s in shapes:
                answers = {}
                for c in order:
                    for n in (counts if r % 2 == 0 else counts[::-1]):
                        res = forward(context, backends[c], batches[s.name], n)
                        ms[c][s.name][n].append(1000 * res.forward_s)
                        answers[c] = res.outputs
                if r == 0 and "torch-float32" in answers:
                    ref = answers["torch-float32"]
                    for c, out in answers.items():
                        cosine[c][s.name] = _min_cosine(out, ref)
            print(f"round {r + 1}/{rounds} done; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        context.shutdown()
    return {"ms": ms, "min_cosine_to_torch_float32": cosine}


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def summarise(ms: dict, counts: list[int]) -> list[dict]:
    """One row per (config, shape): median and best ms per count, the paired speedup of the
    largest count over the smallest with its interval, the paired lead of the count of the
    least median over the runner-up (the next least median; per round, the runner-up's time
    over its), the ``candidates`` (every count whose paired time over the fastest's has an
    interval reaching 1 or below: not shown slower), and the best count: the fastest where it
    is the only candidate, else a tie."""
    rows = []
    lo_n, hi_n = counts[0], counts[-1]
    for c, per_shape in ms.items():
        for s, per_count in per_shape.items():
            ratios = [a / b for a, b in zip(per_count[lo_n], per_count[hi_n], strict=True)]
            med, lo, hi = bootstrap_median(ratios)
            by_median = sorted(counts, key=lambda n: float(np.median(per_count[n])))
            first, second = by_median[0], by_median[1]
            lead = bootstrap_median([b / a for a, b in zip(per_count[first], per_count[second],
                                                           strict=True)])
            candidates = [n for n in counts if n == first or bootstrap_median(
                [b / a for a, b in zip(per_count[first], per_count[n], strict=True)])[1] <= 1]
            rows.append({"config": c, "shape": s,
                         "median_ms": {n: float(np.median(v)) for n, v in per_count.items()},
                         "best_ms": {n: float(min(v)) for n, v in per_count.items()},
                         "speedup": med, "speedup_ci95": [lo, hi],
                         "fastest": first, "runner_up": second, "lead": lead[0],
                         "lead_ci95": [lead[1], lead[2]], "candidates": candidates,
                         "best_count": first if candidates == [first] else "tie"})
    return rows


def verdict(rows: list[dict]) -> list[str]:
    """Per config: does the best count change with input size? It differs where two shapes'
    candidates (the counts not shown slower than the fastest) have none in common."""
    lines = []
    for c in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == c]
        bests = {r["shape"]: r["best_count"] for r in mine}
        decided = {b for b in bests.values() if b != "tie"}
        sets = {r["shape"]: set(r["candidates"]) for r in mine}
        apart = [(a, b) for a in sets for b in sets if a < b and not sets[a] & sets[b]]
        if apart:
            a, b = apart[0]
            what = (f"DIFFERS by input size ({a}: {sorted(sets[a])}, {b}: {sorted(sets[b])}; "
                    f"{len(apart)} such pairs of shapes)")
        elif len(decided) > 1:
            what = "DIFFERS by input size"
        elif decided and "tie" in bests.values():
            what = f"{decided.pop()} or a tie (never another count)"
        elif decided:
            what = f"the same at every size ({decided.pop()})"
        else:
            what = "a tie at every size"
        detail = ", ".join(f"{s}:{b}" for s, b in bests.items())
        lines.append(f"- {c}: best count {what} [{detail}]")
    return lines


def table(rows: list[dict], counts: list[int], cosine: dict) -> list[str]:
    lo_n, hi_n = counts[0], counts[-1]
    head = " | ".join(f"{n} thr ms (best)" for n in counts)
    out = [f"| config | shape | {head} | {lo_n}thr/{hi_n}thr [95% CI] | fastest: its lead over "
           "the runner-up [95% CI] | best | min cos |",
           "|---|---|" + "---|" * len(counts) + "---|---|---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['median_ms'][n]:.2f} ({r['best_ms'][n]:.2f})" for n in counts)
        lo, hi = r["speedup_ci95"]
        lead = (f"{r['fastest']} over {r['runner_up']}: {r['lead']:.2f} "
                f"[{r['lead_ci95'][0]:.2f}, {r['lead_ci95'][1]:.2f}]")
        cos = cosine.get(r["config"], {}).get(r["shape"])
        out.append(f"| {r['config']} | {r['shape']} | {cells} | {r['speedup']:.2f} "
                   f"[{lo:.2f}, {hi:.2f}] | {lead} | {r['best_count']} | "
                   f"{'' if cos is None else f'{cos:.5f}'} |")
    return out


def report(rows: list[dict], counts: list[int], cosine: dict) -> list[str]:
    return [*table(rows, counts, cosine), "",
            f"Does the best thread count differ by input size? (counts {counts})",
            *verdict(rows)]


def resummarise(path: Path) -> int:
    """The summary and report of a stored run, made again from its rounds (``ms``)."""
    try:
        doc = json.loads(path.read_text())
        counts = [int(n) for n in doc["counts"]]
        ms = {c: {s: {int(n): v for n, v in per.items()} for s, per in shapes.items()}
              for c, shapes in doc["ms"].items()}
        doc["summary"] = rows = summarise(ms, counts)
        lines = report(rows, counts, doc["min_cosine_to_torch_float32"])
        doc["report"] = [doc["report"][0], *lines]  # the run's own first line: rounds, load
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise SystemExit(f"--resummarise {path}: not a stored bench.precision run "
                         f"({type(exc).__name__}: {exc})") from exc
    path.write_text(json.dumps(doc, indent=1))
    print("\n".join(lines))
    return 0


def host() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    return {"cpu": cpu, "cpus": os.cpu_count(), "amx": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--counts", default="1,2")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="bench/results/precision.json")
    parser.add_argument("--resummarise", metavar="FILE",
                        help="summarise the rounds stored in FILE again (in place), no forwards")
    args = parser.parse_args(argv)
    if args.resummarise:
        return resummarise(Path(args.resummarise))
    counts = sorted({int(x) for x in args.counts.split(",")})
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    if args.rounds < 2 or len(counts) < 2 or counts[0] < 1:
        raise SystemExit("--rounds must be >= 2 and --counts name >= 2 counts >= 1")
    before = host()
    print(f"{before['cpu']} ({before['cpus']} CPUs, AMX {before['amx']}); {before['uptime']}")
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        backends = load_configs(args.configs.split(","), Path(tmp))
        t0 = time.perf_counter()
        data = measure(backends, shapes, counts, args.rounds, resolve(MODEL).tokenizer_path)
    after = host()
    rows = summarise(data["ms"], counts)
    lines = [f"{args.rounds} interleaved rounds in {time.perf_counter() - t0:.0f} s; "
             f"before: {before['uptime']}; after: {after['uptime']}",
             *report(rows, counts, data["min_cosine_to_torch_float32"])]
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({"host_before": before, "host_after": after,
                                          "counts": counts, "rounds": args.rounds, **data,
                                          "summary": rows, "report": lines}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
