"""Pool and memory cases of the bench (issue: replica pool, Measure; R8.1).

- hung replica: 3 CPU replicas, one whose forward hangs while /health answers, against the
  same 3 healthy, same load: p50/p99, throughput and success rate;
- dispatch by outstanding bytes against round robin (``VLLM_SRUN_DISPATCH=round_robin``),
  same replicas, mixed input sizes;
- overload: a burst over 32 x replicas against slow workers: how fast the 429s come back;
- memory: RSS of one worker process per backend and thread-count set, after serving.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from bench.corpus import texts as make_texts
from bench.loadgen import run_load

MODEL = "all-MiniLM-L6-v2"


def _config(path: Path, replicas: int, timeout_ms: int = 1000, **engine) -> Path:
    doc = {"global": {"router": {"enabled": False}, "model_catalog": {"deployments": {
        "primary": {"provider": "model_runtime", "artifact": MODEL,
                    "replicas": [{"device": "cpu"}] * replicas,
                    "engine": {"num_threads": 1, "max_num_seqs": 32, "timeout_ms": timeout_ms,
                               "cache_entries": 0, **engine},
                    "outlier_detection": {"base_ejection_ms": 30_000}}}}}}
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(work: Path, replicas: int, env: dict | None = None, **engine):
    from bench.run import Proc, free_port

    port = free_port()
    cfg = _config(work / f"config-{port}.yaml", replicas, **engine)
    # faults go in through the test-only launcher (the product has no fault hooks, R9.2)
    proc = Proc([os.sys.executable, "-m", "tests.faults", "--faults", str(work / "faults"), "serve",
                 "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                f"http://127.0.0.1:{port}", env=env)
    end = time.monotonic() + 120
    while time.monotonic() < end:  # every replica ready, not just the first
        inv = httpx.get(proc.url + "/v1/inventory", timeout=10).json()
        if all(r["state"] == "ready" for r in inv["deployments"][0]["replicas"]):
            break
        time.sleep(0.2)
    return proc


def _summary(r) -> dict:
    return {"rps": r.throughput_rps, "p50_ms": r.pct(50), "p99_ms": r.pct(99),
            "requests": r.requests, "errors": r.errors,
            "success": 1 - r.errors / r.requests if r.requests else float("nan")}


def hung_case(work: Path, duration_s: float, clients: int = 6, quick: bool = False) -> dict:
    """quick: both cases on one server, the healthy one first (one start fewer)."""
    corpus = make_texts(20_000, seed=5)
    out = {}
    proc = None
    try:
        for name, fault in (("3 healthy", None), ("3, one hung", "hang")):
            if proc is None:
                proc = _start(work, 3)
                run_load(proc.url, make_texts(64, seed=98), 3, 1.0, MODEL)  # warm
            if fault:
                (work / "faults" / "primary-1").write_text(fault)
            out[name] = _summary(run_load(proc.url, corpus, clients, duration_s, MODEL))
            inv = httpx.get(proc.url + "/v1/inventory", timeout=10).json()
            out[name]["states"] = {r["id"]: r["state"]
                                   for r in inv["deployments"][0]["replicas"]}
            if not quick:
                proc.stop()
                proc = None
    finally:
        (work / "faults" / "primary-1").unlink(missing_ok=True)
        if proc is not None:
            proc.stop()
    return out


def dispatch_case(work: Path, duration_s: float, clients: int = 8) -> dict:
    corpus = make_texts(20_000, seed=6, median_chars=120, max_chars=3000)
    out = {}
    for name, mode in (("fewest outstanding bytes", "bytes"), ("round robin", "round_robin")):
        proc = _start(work, 3, env={"VLLM_SRUN_DISPATCH": mode}, timeout_ms=30_000)
        try:
            run_load(proc.url, make_texts(64, seed=97), 3, 1.0, MODEL)
            out[name] = _summary(run_load(proc.url, corpus, clients, duration_s, MODEL,
                                          extra={"truncate": True}))
        finally:
            proc.stop()
    return out


def overload_case(work: Path, burst: int = 150) -> dict:
    proc = _start(work, 2, timeout_ms=30_000)
    try:
        (work / "faults" / "all").write_text("slow 300")

        async def fire():
            # a bare HTTP/1.1 client on pre-opened connections: httpx's pool serialises a
            # burst this size on the client side, which would measure the client
            host, port = proc.url.removeprefix("http://").split(":")
            conns = [await asyncio.open_connection(host, int(port)) for _ in range(burst)]

            async def one(i, reader, writer):
                body = f'{{"input": "burst {i}"}}'.encode()
                start = time.perf_counter()
                writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                status = int((await reader.readline()).split()[1])
                ms = 1000 * (time.perf_counter() - start)
                writer.close()
                return status, ms

            return await asyncio.gather(*(one(i, r, w) for i, (r, w) in enumerate(conns)))

        results = asyncio.run(fire())
    finally:
        (work / "faults" / "all").unlink(missing_ok=True)
        proc.stop()
    refused = [ms for s, ms in results if s == 429]
    served = [ms for s, ms in results if s == 200]
    return {"burst": burst, "admitted": len(served), "refused": len(refused),
            "other": burst - len(served) - len(refused),
            "refused_p50_ms": float(np.median(refused)) if refused else None,
            "refused_max_ms": float(max(refused)) if refused else None,
            "served_p50_ms": float(np.median(served)) if served else None}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_case(work: Path) -> list[dict]:
    """RSS of one single-worker server per backend and thread-count set, after warm-up and
    after serving 2000 mixed requests (the worker is the server process here)."""
    from bench.run import Proc, free_port

    rows = []
    corpus = make_texts(2000, seed=8)
    for backend in ("onnxruntime", "torch"):
        for threads, top, mode in (("1", "1", "0"), ("2", "2", "0"), ("1", "2", "1")):
            port = free_port()
            proc = Proc([os.sys.executable, "-m", "vllm_srun.server", "serve", MODEL,
                         "--backend", backend, "--threads", threads, "--max-threads", top, "--port",
                         str(port), "--log-level", "warning"], f"http://127.0.0.1:{port}",
                        env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": mode,
                             "VLLM_SRUN_RECORD": str(work / f"mem-{port}.sqlite")})
            try:
                ready = rss_mb(proc.proc.pid)
                run_load(proc.url, corpus, 4, 4.0, MODEL)
                after = rss_mb(proc.proc.pid)
            finally:
                proc.stop()
            rows.append({"backend": backend, "threads": threads, "max_threads": top,
                         "adaptive_mode": mode, "rss_ready_mb": ready,
                         "rss_after_mb": after})
    return rows


def run_all(quick: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    (work / "faults").mkdir()
    duration = 1.5 if quick else 15.0
    return {"hung": hung_case(work, duration, quick=quick),
            "dispatch": dispatch_case(work, duration),
            "overload": overload_case(work), "memory": [] if quick else memory_case(work)}


def report_lines(res: dict) -> list[str]:
    def row(name, r):
        return (f"| {name} | {r['rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                f"{100 * r['success']:.2f}% ({r['errors']} of {r['requests']} failed) |")

    lines = ["", "## Pool: 3 CPU replicas (1 thread each), one hung", "",
             "6 clients, timeout_ms 1000; the hung replica's forward blocks while its /health "
             "answers.", "", "| pool | req/s | p50 ms | p99 ms | answered |",
             "|---|---|---|---|---|"]
    lines += [row(k, v) for k, v in res["hung"].items()]
    hung, ok = res["hung"].get("3, one hung"), res["hung"].get("3 healthy")
    if hung and ok:
        lines += ["", f"With one replica hung: p99 {hung['p99_ms'] / ok['p99_ms']:.2f}x, "
                      f"throughput {hung['rps'] / ok['rps']:.2f}x of the healthy pool; "
                      f"states after: {hung['states']}."]
    lines += ["", "## Pool: dispatch by outstanding bytes against round robin", "",
              "3 replicas, 8 clients, mixed sizes (median ~120 characters, tail to 3000).", "",
              "| dispatch | req/s | p50 ms | p99 ms | answered |", "|---|---|---|---|---|"]
    lines += [row(k, v) for k, v in res["dispatch"].items()]
    o = res["overload"]
    lines += ["", "## Pool: overload", "",
              f"A burst of {o['burst']} concurrent requests against 2 replicas whose forwards "
              f"take 300 ms: {o['admitted']} admitted, {o['refused']} refused with 429 "
              f"(p50 {o['refused_p50_ms'] or float('nan'):.1f} ms, max "
              f"{o['refused_max_ms'] or float('nan'):.1f} ms to the 429), {o['other']} other."]
    if res["memory"]:
        lines += ["", "## Memory: RSS of a worker (MB)", "",
                  "| backend | threads | max threads | adaptive mode | ready | after 4 s of "
                  "load |", "|---|---|---|---|---|---|"]
        lines += [f"| {m['backend']} | {m['threads']} | {m['max_threads']} | "
                  f"{m['adaptive_mode']} | {m['rss_ready_mb']:.0f} | {m['rss_after_mb']:.0f} |"
                  for m in res["memory"]]
    return lines
