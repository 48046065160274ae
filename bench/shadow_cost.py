"""What learning costs served traffic (R4.5 amended), in one process on this machine.

The real engine serves Poisson arrivals of mixed lengths (70% short, 25% passages, 5% long)
with learning off and in mode 1 (shadows on SCHED_IDLE threads), runs alternating A/B/A/B so
the shared machine's drift hits both alike. Reports served latency p50/p99 (arrival to
answer) per load level, and how many shadow samples were kept and discarded.

    python -m bench.shadow_cost [--seconds 15] [--rates 30,60] [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from bench.corpus import mixed_length, token_row
from vllm_srun.records.host_record import Scope
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.golden import golden_rows
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.shadows import ShadowProcess, idle_shadows


def run_once(model: str, backend_name: str, learn: str, rate: float, seconds: float,
             seed: int) -> dict:
    manifest = resolve(model)
    backend = load_backend(manifest, backend_name)
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, cache_entries=0))
    tuner = None
    if learn:
        pause = None
        if learn == "thread":
            shadow_forward, close = idle_shadows(backend)
        else:  # what a deployment runs: a SCHED_IDLE process, frozen beside served forwards
            proc = ShadowProcess(manifest, backend_name)
            shadow_forward, close = proc.forward, proc.close
            pause = proc.pause if learn == "process" else None
        tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("bench", "b", "b"), None,
                                runner.engine.forward_batch, TunerSettings(),
                                shadow_forward=shadow_forward, on_close=close,
                                pause_shadows=pause)
        runner.engine.threads = tuner
        runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
        time.sleep(8)  # the shadow side loads and warms before traffic starts
    else:
        runner.start()
    rng = np.random.default_rng(seed)
    latencies: list[float] = []
    lock = threading.Lock()
    pending = []
    start = time.perf_counter()
    t = start
    while t - start < seconds:
        t += float(rng.exponential(1 / rate))
        time.sleep(max(0.0, t - time.perf_counter()))
        sent = time.perf_counter()
        fut = runner.engine.submit([token_row(mixed_length(rng), rng)])

        def done(_f, sent=sent):
            with lock:
                latencies.append(time.perf_counter() - sent)

        fut.add_done_callback(done)
        pending.append(fut)
    for f in pending:
        f.result(timeout=120)
    out = {"p50_ms": float(np.percentile(latencies, 50) * 1000),
           "p99_ms": float(np.percentile(latencies, 99) * 1000), "n": len(latencies)}
    if tuner is not None:
        out.update(kept=sum(len(v) for r in tuner.learner.ranges.values()
                            for v in r.samples.values()),
                   discarded=tuner.tally.discarded, comparisons=tuner.ledger.comparisons)
    runner.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--rates", default="30,60")
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shadows", default="process,unfrozen,thread",
                   help="where mode 1's shadows run: a SCHED_IDLE child process frozen beside "
                        "served forwards (what deployments use), the same never frozen, and/or "
                        "SCHED_IDLE threads in the worker")
    args = p.parse_args()
    print("| load (req/s) | learning | p50 ms | p99 ms | shadows kept / discarded |")
    print("|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        kinds = ["", *args.shadows.split(",")]
        rows: dict[str, list[dict]] = {k: [] for k in kinds}
        for i in range(args.rounds):
            for learn in kinds:
                rows[learn].append(run_once(args.model, args.backend, learn, rate,
                                            args.seconds, seed=i))
        for learn in kinds:
            rs = rows[learn]
            p50 = np.median([r["p50_ms"] for r in rs])
            p99 = np.median([r["p99_ms"] for r in rs])
            kept = f"{sum(r['kept'] for r in rs)} / {sum(r['discarded'] for r in rs)}" \
                if learn else "-"
            name = {"": "off", "process": "mode 1, shadows in a process, frozen beside served",
                    "unfrozen": "mode 1, shadows in a process, never frozen",
                    "thread": "mode 1, shadows on threads in the worker"}[learn]
            print(f"| {rate:.0f} | {name} | {p50:.2f} | {p99:.2f} | {kept} |", flush=True)


if __name__ == "__main__":
    main()
