"""Precisions over HTTP, side by side with infinity-emb: each server alone, one after another
in one run, driven by wrk at 1 and 16 closed-loop connections with unique mixed bodies (70%
short queries, 25% passages, 5% long; ``bench.adaptive_wrk``'s script).

    python -m bench.precision_http [--infinity .peers/infinity/bin/infinity_emb]
        [--seconds 10] [--rounds 1] [--servers SUBSTRING,...] [--out FILE]

Servers: vllm-srun at ``--dtype float32`` (onnxruntime, the default), ``bfloat16`` (torch)
and ``int8`` (onnxruntime, the default recipe, at the default quality gate), each at the
default thread count, at ``--threads 2`` and with two forwards at once at the default count
(``--concurrent-forwards 2``, where the build has it); infinity-emb 0.0.78 (torch engine, its own
venv) at ``--dtype float32|bfloat16|int8``;
sentence-transformers' ``encode`` behind FastAPI at 2 threads (``bench/peers/st_fastapi.py``).
Every server serves all-MiniLM-L6-v2 from the L6 package's folder, offline, with vllm-srun's
result cache off (every body is unique anyway). Each server gets a short warm run first (not
counted). With ``--rounds`` > 1 the servers are cycled that many times and a server's figure
is its median over rounds.

vllm-srun's ``--dtype`` is passed only where ``serve --help`` lists it: a build without it
runs its float32 servers without the flag and skips the other precisions (said in the
output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.adaptive_wrk import lua, wrk
from bench.loadgen import Refused
from bench.precision import host
from bench.run import Proc, free_port
from vllm_srun.runtime.artifact import resolve

MODEL = "all-MiniLM-L6-v2"
DTYPES = ("float32", "bfloat16", "int8")
LEVELS = (1, 16)
WARM_S = 3.0
ADAPTIVE = "vllm-srun `--adaptive-threads serve`, fresh record, no sweep"


def ours_help() -> str:
    """This build's ``serve --help`` (which flags it has)."""
    return subprocess.run([sys.executable, "-m", "vllm_srun.server", "serve", "--help"],
                          capture_output=True, text=True).stdout


# Per precision, the backend that runs it best here (runtime/precision.py: onnxruntime has no
# bfloat16 kernels worth serving). int8's default recipe (blockwise) passes the default 0.999
# gate for all-MiniLM-L6-v2 (0.9995 measured); the faster per-tensor recipe that needed the
# gate relaxed to 0.98 is no longer what ``--dtype int8`` runs (bench/int8_sweep.py).
OURS: dict[str, tuple[str, ...]] = {
    "float32": (),
    "bfloat16": ("--backend", "torch"),
    "int8": (),
}


def server_table(infinity: str | None, has_dtype: bool, peers: bool = True,
                 at_once: bool = False) -> dict[str, list[str] | None]:
    """name -> the command that starts it (``{port}`` filled in later), or None: skipped.
    ``at_once``: also each precision with two forwards at once (``--concurrent-forwards
    2``, at the default count)."""
    folder = resolve(MODEL).path
    table: dict[str, list[str] | None] = {}
    variants = {"": (), " 2 threads": ("--threads", "2"),
                **({" 2 forwards at once": ("--concurrent-forwards", "2")} if at_once else {})}
    for label, extra in OURS.items():
        dtype = label.split()[0]
        for suffix, threads in variants.items():
            name = f"vllm-srun {label}{suffix}"
            flags = ["--dtype", dtype, *extra] if has_dtype else []
            runnable = has_dtype or dtype == "float32"
            table[name] = ([sys.executable, "-m", "vllm_srun.server", "serve", MODEL, "--port",
                            "{port}", "--cache-entries", "0", "--log-level", "warning",
                            *flags, *threads] if runnable else None)
    for dtype in DTYPES:
        table[f"infinity-emb {dtype}"] = (
            [infinity, "v2", "--model-id", folder, "--engine", "torch", "--dtype", dtype,
             "--port", "{port}", "--served-model-name", MODEL, "--url-prefix", "/v1"]
            if infinity else None)
    # mode 2 as a user starts it: a fresh host record, no sweep (it verifies the shapes its
    # traffic brings), learning under the bench's own 16-client load for ``--learn-s`` first
    table[ADAPTIVE] = [sys.executable, "-m", "vllm_srun.server", "serve", MODEL, "--port",
                       "{port}", "--cache-entries", "0", "--log-level", "warning",
                       "--adaptive-threads", "serve", "--record", "{record}"]
    if peers:  # sentence-transformers' encode behind FastAPI, as a user would write it
        table["sentence-transformers + FastAPI, 2 threads"] = [
            sys.executable, "-m", "bench.peers.st_fastapi", str(folder), "{port}", "2"]
    return table


def measure(cmd: list[str], script: str, seconds: float, seed: int,
            learn_s: float = 0.0) -> dict:
    """One server: started, warmed, then each level. An adaptive one (``{record}`` in its
    command: a fresh record) first learns under 16 connections for ``learn_s``."""
    port = free_port()
    t0 = time.monotonic()
    learns = any("{record}" in c for c in cmd)
    record = tempfile.mkdtemp(prefix="bench-record-") + "/record.sqlite"
    cmd = [c.replace("{port}", str(port)).replace("{record}", record) for c in cmd]
    proc = Proc(cmd, f"http://127.0.0.1:{port}",
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"})
    out: dict = {"start_s": time.monotonic() - t0}
    try:
        wrk(proc.url, script, 1, WARM_S, seed=seed + 999)
        if learns and learn_s > 0:
            out["learn"] = wrk(proc.url, script, max(LEVELS), learn_s, seed=seed + 777)
            out["learn"]["seconds"] = learn_s
        for level in LEVELS:
            out[str(level)] = wrk(proc.url, script, level, seconds, seed=seed + level)
        if learns:  # what it learned and served, as its report says
            with urllib.request.urlopen(proc.url + "/v1/threads", timeout=30) as answer:
                out["threads"] = json.load(answer)
    finally:
        proc.stop()
    return out


def line(name: str, runs: list[dict]) -> str:
    cells = []
    for level in LEVELS:
        got = [r[str(level)] for r in runs if str(level) in r]
        rps = statistics.median(r["rps"] for r in got)
        p50 = statistics.median(r["p50_ms"] for r in got)
        p99 = statistics.median(r["p99_ms"] for r in got)
        bad = sum(r["non_2xx"] + r["errors"] for r in got)
        cells.append(f"{rps:.1f} | {p50:.1f} | {p99:.1f}" + (f" ({bad} failed)" if bad else ""))
    return f"| {name} | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_http")
    parser.add_argument("--infinity", default=os.environ.get("VLLM_SRUN_BENCH_INFINITY"),
                        help="infinity_emb executable in its own venv (none: skip infinity)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--servers", default="",
                        help="comma-separated substrings (=NAME: that name exactly); run only "
                             "servers whose name has one")
    parser.add_argument("--learn-s", type=float, default=120.0,
                        help="adaptive servers: seconds of 16-connection load before measuring")
    parser.add_argument("--out", default="bench/results/precision_http.json")
    args = parser.parse_args(argv)
    if args.seconds < 1 or args.rounds < 1 or args.learn_s < 0:
        raise SystemExit("--seconds must be >= 1, --rounds >= 1 and --learn-s >= 0")
    if args.infinity and not Path(args.infinity).is_file():
        raise SystemExit(f"--infinity: no such file {args.infinity!r}")
    flags = ours_help()
    has_dtype = "--dtype" in flags
    wanted = [w for w in args.servers.split(",") if w]
    table = {k: v for k, v in server_table(args.infinity, has_dtype,
                                           at_once="--concurrent-forwards" in flags).items()
             if not wanted or any(k == w[1:] if w.startswith("=") else w in k
                                  for w in wanted)}
    before = host()
    print(f"{before['cpu']} (AMX {before['amx']}); {before['uptime']}; vllm-srun --dtype "
          f"{'supported' if has_dtype else 'NOT supported: float32 only, without the flag'}")
    results: dict[str, list[dict]] = {k: [] for k, v in table.items() if v}
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(lua(MODEL))
        script.flush()
        for r in range(args.rounds):
            for name, cmd in table.items():
                if cmd is None:
                    continue
                try:
                    results[name].append(measure(cmd, script.name, args.seconds, 1000 * r,
                                                 args.learn_s))
                except (TimeoutError, Refused, OSError, subprocess.SubprocessError) as exc:
                    print(f"{name}: did not run ({exc})", flush=True)
                    continue
                print(line(name, results[name][-1:]), f"(round {r + 1}; load "
                      f"{os.getloadavg()[0]:.2f})", flush=True)
    head = " | ".join(f"{c} conn req/s | p50 ms | p99 ms" for c in LEVELS)
    report = [f"| server | {head} |", "|---|" + "---|---|---|" * len(LEVELS)]
    report += [line(k, v) for k, v in results.items() if v]
    report += [f"| {k} | not run: {'no --infinity given' if 'infinity' in k else 'no --dtype'}"
               " |" for k, v in table.items() if v is None]
    after = host()
    report.append(f"before: {before['uptime']}; after: {after['uptime']}")
    print("\n".join(report))
    Path(args.out).write_text(json.dumps({"host_before": before, "host_after": after,
                                          "seconds": args.seconds, "levels": list(LEVELS),
                                          "results": results, "report": report}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
