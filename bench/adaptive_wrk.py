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

The pieces are shared with ``bench.adaptive_load`` (Poisson levels, a per-class oracle, a
neighbour): the wrk Lua script, the wrk runner, the server, the learning phase.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

LEARNING = "VLLM_SRUN_CPU_ADAPTIVE_THREADS"
# Length classes: (name, share of requests, words per body).
MIX = (("short", 0.70, 6), ("passage", 0.25, 40), ("long", 0.05, 150))

LUA = r"""
local words = {"the","search","query","result","vector","model","server","thread","input",
  "token","embedding","latency","throughput","request","answer","system","memory","batch",
  "length","short","long","kernel","host","python","record","cache","route","worker"}
local classes = CLASSES  -- {cumulative share, words}
local think_ms = THINK_MS  -- mean exponential think time before each request, or nil
local n_threads = 0
function setup(thread)
  n_threads = n_threads + 1
  thread:set("tid", n_threads)
end
local counter = 0
function init(args)
  -- a seed after wrk's "--": every server of a round gets the same bodies and think times
  math.randomseed((tonumber(args[1]) or os.time()) * 1000 + tid)
end
if think_ms then
  function delay() return -math.log(1 - math.random()) * think_ms end
end
request = function()
  counter = counter + 1
  local u, n = math.random(), classes[#classes][2]
  for _, c in ipairs(classes) do
    if u < c[1] then n = c[2]; break end
  end
  local parts = {"t" .. tid .. "r" .. counter .. "s" .. math.random(1000000)}
  for i = 1, n do parts[#parts + 1] = words[math.random(#words)] end
  local body = '{"model":"MODEL","input":["' .. table.concat(parts, " ") .. '"]}'
  return wrk.format("POST", "/v1/embeddings", {["Content-Type"] = "application/json"}, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d us=%d mean_us=%.1f p50_us=%.0f p99_us=%.0f "
    .. "non2xx=%d errors=%d\n", summary.requests, summary.duration, latency.mean,
    latency:percentile(50), latency:percentile(99), e.status,
    e.connect + e.read + e.write + e.timeout))
  local tail = {}
  for i = 0, TAIL_POINTS - 2 do
    tail[#tail + 1] = string.format("%.0f", latency:percentile(TAIL_FROM + i * TAIL_STEP))
  end
  tail[#tail + 1] = string.format("%.0f", latency.max)  -- percentile(100) reads 0
  io.write("TAIL " .. table.concat(tail, ",") .. "\n")
end
"""
# wrk's latency quantiles from TAIL_FROM% to 100% in TAIL_STEP% steps, per run: the runs of
# one server pool into one tail (``pooled_percentile``)
TAIL_FROM, TAIL_STEP, TAIL_POINTS = 90.0, 0.05, 201


def lua(model: str, mix=MIX, think_ms: float | None = None) -> str:
    """A wrk script: unique bodies (thread id, counter, random number) of the mix's lengths;
    with ``think_ms``, each connection waits an exponential time of that mean before each
    request (wrk's ``delay()``)."""
    total, cum, classes = sum(share for _, share, _ in mix), 0.0, []
    for _, share, words in mix:
        cum += share / total
        classes.append(f"{{{cum:.6f}, {words}}}")
    classes[-1] = f"{{2, {mix[-1][2]}}}"  # the last class takes whatever rounding left
    return (LUA.replace("TAIL_POINTS", str(TAIL_POINTS)).replace("TAIL_FROM", str(TAIL_FROM))
            .replace("TAIL_STEP", str(TAIL_STEP))
            .replace("CLASSES", "{" + ", ".join(classes) + "}", 1)
            .replace("THINK_MS", "nil" if think_ms is None else f"{think_ms:.3f}", 1)
            .replace("MODEL", model))


def wrk(url: str, script: str, connections: int, seconds: float,
        seed: int | None = None) -> dict:
    """One wrk run: req/s (all completed responses), mean/p50/p99 ms, non-2xx, socket errors.
    ``seed``: the script's random numbers (bodies, lengths, think times) start from it, so
    runs with one seed against different servers send the same requests at the same pace
    (common random numbers: a paired ratio then compares the servers, not two draws of
    Poisson arrivals; without, fixed 1's own p99 at 60% of capacity spanned 63-127 ms over
    five runs). A server's runs need different seeds: its result cache would answer
    repeats."""
    proc = subprocess.run(["wrk", "-t", str(min(connections, 2)), "-c", str(connections),
                           "-d", f"{max(1, round(seconds))}s", "--timeout", "30s", "-s", script,
                           url, *(["--", str(seed)] if seed is not None else [])],
                          capture_output=True, text=True, timeout=seconds + 90)
    m = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if not m:
        print(f"wrk gave no result (rc {proc.returncode}): {proc.stderr.strip()[-300:]}",
              file=sys.stderr, flush=True)
        return {"rps": float("nan"), "mean_ms": float("nan"), "p50_ms": float("nan"),
                "p99_ms": float("nan"), "non_2xx": 0, "errors": 0, "requests": 0}
    r = {k: float(v) for k, v in re.findall(r"(\w+)=(\S+)", m[1])}
    tail = re.search(r"^TAIL (.*)$", proc.stdout, re.M)
    return {"rps": r["requests"] / r["us"] * 1e6 if r["us"] else float("nan"),
            "mean_ms": r["mean_us"] / 1e3, "p50_ms": r["p50_us"] / 1e3,
            "p99_ms": r["p99_us"] / 1e3, "non_2xx": int(r["non2xx"]),
            "errors": int(r["errors"]), "requests": int(r["requests"]),
            "tail_us": [float(v) for v in tail[1].split(",")] if tail else []}


def pooled_percentile(runs: list[dict], pct: float = 99.0) -> float | None:
    """The ``pct`` percentile (ms, ``pct`` >= ``TAIL_FROM``) of the runs' requests taken
    together: each run's tail quantiles (``tail_us``), weighted by its request count, give
    how many of its requests were slower than a latency (linear between quantiles). One
    8-s run's p99 rests on its few slowest requests; rounds pooled rest on several times
    more."""
    tails = [(r["requests"], r["tail_us"]) for r in runs if r.get("tail_us") and r["requests"]]
    if not tails:
        return None
    points = [TAIL_FROM + i * TAIL_STEP for i in range(TAIL_POINTS)]

    def slower(v: float) -> float:
        n_slower = 0.0
        for n, t in tails:
            k = bisect.bisect_right(t, v)
            if k == 0:
                below = points[0]  # at most: the run's tail starts above v
            elif k == len(t):
                below = 100.0
            else:
                lo, hi = t[k - 1], t[k]
                below = points[k - 1] + (points[k] - points[k - 1]) * (
                    (v - lo) / (hi - lo) if hi > lo else 1.0)
            n_slower += n * (1 - below / 100)
        return n_slower

    allowed = sum(n for n, _ in tails) * (1 - pct / 100)
    values = sorted({v for _, t in tails for v in t})
    i = bisect.bisect_left(values, True, key=lambda v: slower(v) <= allowed)
    return values[min(i, len(values) - 1)] / 1e3


def batch_limits(max_num_batched_tokens: int = 512) -> list[str]:
    """The adaptive benches' batch limits: every server and the voucher sweep take the same
    (a voucher covers only the shapes of the limits it was swept over)."""
    return ["--max-num-seqs", "32", "--max-num-batched-tokens", str(max_num_batched_tokens)]


def verify(model: str, record: str, limits: list[str]) -> None:
    """``threads verify`` over the servers' own batch limits (mode 2's voucher)."""
    proc = subprocess.run([sys.executable, "-m", "vllm_srun.server", "threads", "verify", model,
                           "--record", record, *limits], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"threads verify failed ({proc.returncode}): {proc.stderr[-2000:]}")


def learn(url: str, script: str, bursts: int, burst_s: float = 4, pause_s: float = 1,
          rest_s: float = 5) -> None:
    """Learning traffic: the first third of the bursts at 1 connection, the rest at 16, a
    pause after each (shadows time batches in the gaps), a longer rest at the end."""
    for i in range(bursts):
        wrk(url, script, 1 if i < bursts // 3 else 16, burst_s)
        time.sleep(pause_s)
    time.sleep(rest_s)


def threads_summary(report: dict) -> str:
    """``GET /v1/threads`` in a few lines: top-level state, then one line per range."""
    if "ranges" not in report:
        return f"  {report}"
    v = report.get("voucher") or {}
    lines = [f"  mode {report.get('mode')}, configured {report.get('configured_threads')}, "
             f"allowed {report.get('allowed_counts')}, voucher "
             f"{'yes' if v.get('vouches') else 'no'}, uncovered forwards "
             f"{report.get('uncovered_forwards', 0)}, drift "
             f"{'yes' if report.get('drift') else 'no'}"]
    lines += [f"  state {report.get('state')}: {report.get('recommendation')}"]
    lines += [f"  note: {n}" for n in report.get("notes", [])]
    lines += [f"  {r['size_range']:>9}: served {r['served_threads']}, learned "
              f"{r['learned_threads']}, {r['state']}, samples "
              f"{ {k: c['samples'] for k, c in r['counts'].items()} }"
              for r in report["ranges"]]
    return "\n".join(lines)


def range_states(report: dict) -> dict[str, str]:
    """Each range of a ``GET /v1/threads`` report as "served/learned state verified passes":
    ``{"64-127": "1/2 learned 5"}`` (learned 2, serving 1 until its window passes)."""
    return {r["size_range"]: f"{r['served_threads']}/{r['learned_threads']} {r['state']} "
                             f"{r.get('verified_passes', 0)}"
            for r in report.get("ranges", ())}


def range_counts(report: dict) -> dict[str, dict]:
    """Each range's per-count figures of a ``GET /v1/threads`` report (median, ~80% interval,
    samples, why a count was not timed): what a range decided on."""
    return {r["size_range"]: r.get("counts", {}) for r in report.get("ranges", ())}


class Server:
    def __init__(self, model: str, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "vllm_srun.server", "serve", model, *args,
               "--port", "0", "--log-level", "warning"]
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (tail: why a start failed)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env={**os.environ, **env})
        line = self.proc.stdout.readline()
        # Keep draining stdout so that a chatty server never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.url = line.strip().rsplit(" ", 1)[-1]
        end = time.monotonic() + 180
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stderr.seek(0)
        tail = self.stderr.read()[-2000:]
        self.close()
        raise RuntimeError(f"server not ready (exit {self.proc.returncode}, first line "
                           f"{line!r}): {tail}")

    def threads(self) -> dict:
        return httpx.get(f"{self.url}/v1/threads", timeout=30).json()["reports"][0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)
        self.stderr.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--learn-bursts", type=int, default=10)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args()
    limits = batch_limits(args.max_num_batched_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="adaptive-wrk-"))
    script = tmp / "mixed.lua"
    script.write_text(lua(args.model))
    record = str(tmp / "record.sqlite")
    verify(args.model, record, limits)
    servers = {"fixed 1 (default)": (limits, {}), "fixed 2": (["--threads", "2", *limits], {}),
               "mode 1": (["--record", record, *limits], {LEARNING: "1"}),
               "mode 2": (["--record", record, *limits], {LEARNING: "2"})}
    for name, (flags, env) in servers.items():
        with Server(args.model, flags, env) as server:
            if env:  # learn: bursts with 1 s pauses, at 1 and at 16 connections
                learn(server.url, str(script), args.learn_bursts)
            for conns in (1, 16):
                res = wrk(server.url, str(script), conns, args.seconds)
                print(f"{name:18} c={conns:2}  {res['rps']:7.1f} req/s  p50 {res['p50_ms']:7.2f}"
                      f" ms  p99 {res['p99_ms']:7.2f} ms  non-2xx {res['non_2xx']}", flush=True)
            if env:
                print(threads_summary(server.threads()), flush=True)


if __name__ == "__main__":
    main()
