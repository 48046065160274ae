"""Memory of a worker with learning off (mode 0) and on (modes 1 and 2, with its shadow
process), counted honestly: PSS from ``/proc/<pid>/smaps_rollup``, which splits each shared
page among the processes that map it (RSS counts a page the worker and its shadow child
share twice).

    python -m bench.memory [--backend onnxruntime] [--dtype float32] [--settle 30]
                           [--out bench/results/memory.json]

For each mode, one ``vllm-srun serve`` of the default model (one worker, in the server's
process) with a fresh record and the result cache off gets light traffic of mixed lengths
(one request every 0.25 s, so shadows run in the gaps) for ``--settle`` seconds, until the
shadow process has compared at least one forward. Then the PSS of every process of the server
is read: the worker, the shadow child, the zygote it was forked from (``tuner/zygote.py``)
or, for a spawned child, multiprocessing's resource tracker. Printed per mode:
PSS worker / shadow child / others / total, the total's ratio to mode 0, and the child's
split into the shared weights file, other file-backed pages (libraries) and private memory.
Then, in this process, served forwards over private and shared weights side by side at 1 and
2 threads (a shared load must not be slower). Figures move with the host and its load: run
modes side by side, as here, and nothing else that maps the same libraries (another torch
process lowers the libraries' share of every process here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.run import Proc, free_port

MODEL = "all-MiniLM-L6-v2"
MODES = {0: "off", 1: "learn", 2: "serve"}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "bright", "stars", "shine", "above", "quiet", "hills", "and", "rivers", "run", "toward",
         "distant", "silver", "oceans", "under", "morning", "light"]


def smaps_rollup(pid: int) -> dict[str, int]:
    """Fields of ``/proc/<pid>/smaps_rollup`` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


def mapping_pss_kb(pid: int, marker: str) -> tuple[int, int]:
    """(RSS, PSS) in kB of the mappings of files whose path contains ``marker``."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            inside = len(head) >= 6 and marker in head[5]
        elif inside and head[0] == "Rss:":
            rss += int(head[1])
        elif inside and head[0] == "Pss:":
            pss += int(head[1])
    return rss, pss


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def role(pid: int, root: int) -> str:
    if pid == root:
        return "worker"
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if comm in ("vllm-zygote", "vllm-shadows"):  # forked by the worker's zygote
        return "zygote" if comm == "vllm-zygote" else "shadow"
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return "shadow" if "multiprocessing" in cmd else "other"


def text(rng: np.random.Generator) -> str:
    n = int(rng.choice([4, 12, 40, 120]))
    return " ".join(rng.choice(WORDS, n))


def shadow_comparisons(url: str) -> int:
    report = httpx.get(f"{url}/v1/threads", timeout=30).json()["reports"][0]
    return int(report.get("learning", {}).get("shadow_comparisons", 0))


def measure(mode: int, args: argparse.Namespace, folder: Path) -> dict:
    port = free_port()
    record = folder / f"record-{mode}.sqlite"
    proc = Proc([sys.executable, "-m", "vllm_srun.server", "serve", args.model, "--port",
                 str(port), "--backend", args.backend, "--dtype", args.dtype,
                 "--adaptive-threads", MODES[mode], "--record", str(record),
                 "--cache-entries", "0", "--log-level", "warning"],
                f"http://127.0.0.1:{port}")
    rng = np.random.default_rng(mode)
    try:
        end = time.monotonic() + args.settle
        compared = 0
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < end or (mode and compared == 0
                                             and time.monotonic() < end + args.settle):
                r = client.post(f"{proc.url}/v1/embeddings",
                                json={"model": args.model, "input": [text(rng)]})
                r.raise_for_status()
                time.sleep(0.25)
                if mode:
                    compared = shadow_comparisons(proc.url)
        time.sleep(2)  # shadows in flight end
        root = proc.proc.pid
        processes = []
        for pid in tree(root):
            try:
                roll = smaps_rollup(pid)
                shared = mapping_pss_kb(pid, "/shared/")
                processes.append({"pid": pid, "role": role(pid, root),
                                  "rss_mb": roll["Rss"] / 1024, "pss_mb": roll["Pss"] / 1024,
                                  "pss_anon_mb": roll.get("Pss_Anon", 0) / 1024,
                                  "pss_file_mb": roll.get("Pss_File", 0) / 1024,
                                  "shared_weights_rss_mb": shared[0] / 1024,
                                  "shared_weights_pss_mb": shared[1] / 1024})
            except OSError:
                continue
    finally:
        proc.stop()
    return {"mode": mode, "shadow_comparisons": compared, "processes": processes}


def prepare(args: argparse.Namespace) -> None:
    """Export the model and write its shared weights before any server is measured (a
    first start's export would weigh on mode 0 alone)."""
    code = ("import sys; from vllm_srun.runtime.artifact import resolve; "
            "from vllm_srun.runtime.backend import load_backend; "
            "load_backend(resolve(sys.argv[1]), sys.argv[2], precision=sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, args.model, args.backend, args.dtype],
                   check=True)


FORWARD_SHAPES = ((1, 16), (4, 64), (8, 128))  # rows x tokens


def forward_timing(args: argparse.Namespace) -> list[dict]:
    """Served forwards over private against shared weights, in this process, A/B in each
    round (rounds alternate which side runs first; each side warmed before): per shape and
    count, the median over rounds of (shared / private), each round's figure the median of
    ``--forward-reps`` forwards, and the rounds' spread."""
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import OnnxBackend, TorchBackend, load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.precision import Precision
    from vllm_srun.runtime.threads import ThreadContext

    manifest, precision = resolve(args.model), Precision(args.dtype)
    shared = load_backend(manifest, args.backend, precision=precision)
    private = (OnnxBackend(manifest, shared.onnx_path, precision=precision)
               if args.backend == "onnxruntime"
               else TorchBackend(manifest, precision=precision, share_weights=False))
    context, rng, rows = ThreadContext(), np.random.default_rng(0), []
    for n_rows, tokens in FORWARD_SHAPES:
        batch = pad([[101, *rng.integers(1000, 29000, tokens - 2).tolist(), 102]
                     for _ in range(n_rows)])
        for n in (1, 2):
            for backend in (private, shared):  # sessions and thread pools made, warmed
                context.run(n, lambda b=backend, k=n, x=batch: b.forward(x, k))
            ratios = []
            for i in range(args.forward_rounds):
                med = {}
                sides = (("private", private), ("shared", shared))
                for name, backend in sides if i % 2 == 0 else sides[::-1]:
                    def one(b=backend, k=n, x=batch) -> float:
                        return context.run(k, lambda: b.forward(x, k)).forward_s

                    times = [one() for _ in range(args.forward_reps)]
                    med[name] = float(np.median(times))
                ratios.append(med["shared"] / med["private"])
            rows.append({"rows": n_rows, "tokens": tokens, "threads": n,
                         "shared_over_private": float(np.median(ratios)),
                         "rounds_min": min(ratios), "rounds_max": max(ratios)})
    context.shutdown()
    return rows


def summary(run: dict) -> dict:
    by = {}
    for p in run["processes"]:
        by[p["role"]] = by.get(p["role"], 0.0) + p["pss_mb"]
    worker, shadow = by.get("worker", 0.0), by.get("shadow", 0.0)
    return {"worker": worker, "shadow": shadow,
            "others": sum(by.values()) - worker - shadow, "total": sum(by.values())}


def print_table(runs: list[dict]) -> None:
    base = summary(runs[0])["total"]
    print("| mode | PSS worker MB | PSS shadow child MB | others MB | total MB | x mode 0 |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        s = summary(run)
        print(f"| {run['mode']} | {s['worker']:.0f} | {s['shadow']:.0f} | {s['others']:.0f} "
              f"| {s['total']:.0f} | {s['total'] / base:.2f} |")
    print("\nPer process (MB): PSS of the shared weights file / of other files (libraries) / "
          "anonymous; RSS of the weights file (counts a page the other process maps too)")
    for run in runs:
        for p in run["processes"]:
            if p["role"] in ("worker", "shadow"):
                print(f"  mode {run['mode']} {p['role']}: weights {p['shared_weights_pss_mb']:.0f}"
                      f" / files {p['pss_file_mb'] - p['shared_weights_pss_mb']:.0f}"
                      f" / anonymous {p['pss_anon_mb']:.0f}; weights RSS "
                      f"{p['shared_weights_rss_mb']:.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    p.add_argument("--settle", type=float, default=30.0,
                   help="seconds of light traffic before memory is read")
    p.add_argument("--modes", default="0,1,2")
    p.add_argument("--forward-rounds", type=int, default=7,
                   help="A/B rounds of the forward timing, private against shared weights "
                        "(0: none)")
    p.add_argument("--forward-reps", type=int, default=9, help="forwards per side and round")
    p.add_argument("--out", default=None, help="results JSON (default: print only)")
    args = p.parse_args(argv)
    prepare(args)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        runs = [measure(int(m), args, Path(tmp)) for m in args.modes.split(",")]
    print_table(runs)
    timing = forward_timing(args) if args.forward_rounds > 0 else []
    if timing:
        print("\nServed forward, shared / private weights (median over A/B rounds, min-max)")
        for t in timing:
            print(f"  {t['rows']}x{t['tokens']} at {t['threads']} thread(s): "
                  f"{t['shared_over_private']:.3f} ({t['rounds_min']:.2f}-{t['rounds_max']:.2f})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"model": args.model, "backend": args.backend, "dtype": args.dtype,
             "settle_s": args.settle, "runs": runs,
             "summary_mb": [summary(r) for r in runs], "forward": timing}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
