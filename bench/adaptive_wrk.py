"""Adaptive threads measured over HTTP with a C load generator (wrk), each server alone.

Servers: fixed 1 thread (the default here), fixed 2, mode 1 and mode 2 (after `threads
verify`). An adaptive server first learns from bursts of traffic with short pauses (1 client,
then 16 clients, so the large micro-batches that only load makes are reached), then every
server is measured at 1 and 16 closed-loop connections with unique mixed bodies (70% short
queries, 25% passages, 5% long).

    python -m bench.adaptive_wrk [--model all-MiniLM-L6-v2] [--seconds 15] [--learn-bursts 10]
                                 [--max-num-batched-tokens 512]

Every server runs with the same ``--max-num-batched-tokens`` (and ``--max-num-seqs 32``), and
``threads verify`` sweeps exactly those shapes, so mode 2's voucher covers every forward the
servers can run (the default bounds sweep thousands of shapes: minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

LUA = r"""
local words = {"the","search","query","result","vector","model","server","thread","input",
  "token","embedding","latency","throughput","request","answer","system","memory","batch",
  "length","short","long","kernel","host","python","record","cache","route","worker"}
local n_threads = 0
function setup(thread)
  n_threads = n_threads + 1
  thread:set("tid", n_threads)
end
local counter = 0
function init(args)
  math.randomseed(os.time() * 1000 + tid)
end
request = function()
  counter = counter + 1
  local u = math.random()
  local n = 6
  if u > 0.95 then n = 150 elseif u > 0.70 then n = 40 end
  local parts = {"t" .. tid .. "r" .. counter .. "s" .. math.random(1000000)}
  for i = 1, n do parts[#parts + 1] = words[math.random(#words)] end
  local body = '{"model":"MODEL","input":["' .. table.concat(parts, " ") .. '"]}'
  return wrk.format("POST", "/v1/embeddings", {["Content-Type"] = "application/json"}, body)
end
"""


def wrk(url: str, script: str, connections: int, seconds: float) -> dict:
    out = subprocess.run(["wrk", "-t", str(min(connections, 2)), "-c", str(connections),
                          "-d", f"{seconds:.0f}s", "--latency", "-s", script, url],
                         capture_output=True, text=True, timeout=seconds + 60).stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m[2]]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": float(rps[1]) if rps else float("nan"), "p50_ms": ms("50"),
            "p99_ms": ms("99"), "non_2xx": int(errors[1]) if errors else 0}


class Server:
    def __init__(self, model: str, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "vllm_srun.server", "serve", model, *args,
               "--port", "0", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env={**os.environ, **env})
        line = self.proc.stdout.readline()
        self.url = line.strip().rsplit(" ", 1)[-1]
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready: {line}")

    def threads(self) -> dict:
        return httpx.get(f"{self.url}/v1/threads", timeout=30).json()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--learn-bursts", type=int, default=10)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args()
    limits = ["--max-num-seqs", "32", "--max-num-batched-tokens",
              str(args.max_num_batched_tokens)]
    tmp = Path(tempfile.mkdtemp(prefix="adaptive-wrk-"))
    script = tmp / "mixed.lua"
    script.write_text(LUA.replace("MODEL", args.model))
    record = str(tmp / "record.sqlite")
    subprocess.run([sys.executable, "-m", "vllm_srun.server", "threads", "verify",
                    args.model, "--record", record, *limits], check=True, capture_output=True)
    servers = {"fixed 1 (default)": (limits, {}), "fixed 2": (["--threads", "2", *limits], {}),
               "mode 1": (["--record", record, *limits],
                          {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"}),
               "mode 2": (["--record", record, *limits],
                          {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "2"})}
    rows = []
    for name, (flags, env) in servers.items():
        server = Server(args.model, flags, env)
        try:
            if env:  # learn: bursts with 1 s pauses, at 1 and at 16 connections
                for i in range(args.learn_bursts):
                    wrk(server.url, str(script), 1 if i < args.learn_bursts // 3 else 16, 4)
                    time.sleep(1)
                time.sleep(5)
            for conns in (1, 16):
                res = wrk(server.url, str(script), conns, args.seconds)
                rows.append((name, conns, res))
                print(f"{name:18} c={conns:2}  {res['rps']:7.1f} req/s  p50 {res['p50_ms']:7.2f}"
                      f" ms  p99 {res['p99_ms']:7.2f} ms  non-2xx {res['non_2xx']}", flush=True)
            if env:
                rep = server.threads()
                print("  " + "; ".join(
                    f"{r['size_range']}: served {r['served_threads']}, learned "
                    f"{r['learned_threads']}, {r['state']}, samples "
                    f"{ {k: v['samples'] for k, v in r['counts'].items()} }"
                    for r in rep["ranges"]), flush=True)
        finally:
            server.close()


if __name__ == "__main__":
    main()
