"""The whole comparison in one run: ``python -m bench.run [--quick] [--out DIR]``.

``--quick`` (CI-sized): shorter loads, warm-ups and round trips (30), the pool cases shorter
(the hung replica and its healthy baseline on one server), and of the servers only those the
report's ratios and oracle need (no unbatched server, no mode 1).

Every server is started here, one at a time on the same machine, and driven by the same load
generator (bench/loadgen.py) with the same texts; figures are read as ratios within this run.
Writes ``report.md`` and ``results.json`` into the output folder.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.corpus import texts as make_texts
from bench.loadgen import Refused, run_load, wait_healthy
from bench.pool import report_lines as pool_lines
from bench.pool import run_all as run_pool
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.export import ensure_onnx
from vllm_srun.runtime.threads import ThreadContext

MODEL = "all-MiniLM-L6-v2"
LEARN_S = 25.0  # seconds of one-client traffic an adaptive server learns from first
SHORT = "hello world, how are you"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forward_table(sizes: list[int], counts: list[int], repeats: int) -> list[dict]:
    manifest = resolve(MODEL)
    context = ThreadContext()
    rows = []
    try:
        for backend_name in ("onnxruntime", "torch"):
            backend = load_backend(manifest, backend_name)
            for tokens in sizes:
                batch = pad([[101] + [7592] * (tokens - 2) + [102]])
                per_count = {}
                for n in counts:
                    def once(b=backend, n=n, batch=batch):
                        return b.forward(batch, n)

                    context.run(n, once)  # warm
                    times = [context.run(n, once).forward_s for _ in range(repeats)]
                    per_count[n] = [1000 * t for t in times]
                rows.append({"backend": backend_name, "tokens": tokens, "ms": per_count})
    finally:
        context.shutdown()
    return rows


def short_forward_ms(repeats: int) -> float:
    """Forward p50 of SHORT at the server's default count, onnxruntime, in-process."""
    from vllm_srun.runtime.budget import default_threads
    from vllm_srun.runtime.tokenizer import Tokenizer

    manifest = resolve(MODEL)
    n = default_threads(cpu_budget())
    batch = pad(Tokenizer(manifest.tokenizer_path, manifest.max_tokens).encode([SHORT]))
    backend = load_backend(manifest, "onnxruntime")
    context = ThreadContext()
    try:
        times = [context.run(n, lambda: backend.forward(batch, n)).forward_s
                 for _ in range(repeats + 5)][5:]
    finally:
        context.shutdown()
    return 1000 * float(np.median(times))


class Proc:
    def __init__(self, cmd: list[str], url: str, env: dict | None = None,
                 health: str = "/health") -> None:
        self.url = url
        # read by nobody, so a chatty peer never blocks; closed in stop()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            wait_healthy(url, path=health)
        except (TimeoutError, Refused):
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def servers(infinity: str | None, record: str, neighbour: bool = False,
            quick: bool = False) -> dict[str, callable]:
    py = sys.executable
    onnx = str(ensure_onnx(resolve(MODEL)))
    tok = resolve(MODEL).tokenizer_path

    def ours(*flags: str, mode: str = "0"):
        def start():
            port = free_port()
            own = f"{record}.{port}"  # each server learns from scratch, keeping the voucher
            shutil.copy(record, own)
            env = {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": mode, "VLLM_SRUN_RECORD": own}
            proc = Proc([py, "-m", "vllm_srun.server", "serve", MODEL, "--port", str(port),
                         "--cache-entries", "0", "--log-level", "warning", *flags],
                        f"http://127.0.0.1:{port}", env=env)
            if mode != "0":  # learn from paced traffic first (shadows run in its pauses)
                run_load(proc.url, make_texts(3000, seed=7), 2, LEARN_S, MODEL, think_s=0.02)
            return proc
        return start

    def fastapi_ort():
        port = free_port()
        return Proc([py, "-m", "bench.peers.fastapi_ort", onnx, tok, str(port), "2"],
                    f"http://127.0.0.1:{port}")

    def st_fastapi():
        port = free_port()
        return Proc([py, "-m", "bench.peers.st_fastapi", resolve(MODEL).path, str(port), "2"],
                    f"http://127.0.0.1:{port}", env={"HF_HUB_OFFLINE": "1"})

    def infinity_emb():
        port = free_port()
        return Proc([infinity, "v2", "--model-id", resolve(MODEL).path, "--engine", "torch",
                     "--port", str(port), "--served-model-name", MODEL, "--url-prefix", "/v1"],
                    f"http://127.0.0.1:{port}", env={"HF_HUB_OFFLINE": "1"},
                    health="/health")

    adaptive = ("--threads", "1", "--max-threads", "2")
    table = {
        "vllm-srun (default threads)": ours(),
        "vllm-srun (2 threads)": ours("--threads", "2"),
        **({} if quick else {
            "vllm-srun (2 threads, no batching)": ours("--threads", "2", "--max-num-seqs", "1"),
            "vllm-srun adaptive mode 1 (1 thread, max 2)": ours(*adaptive, mode="1")}),
        "vllm-srun adaptive mode 2 (1 thread, max 2)": ours(*adaptive, mode="2"),
        "fastapi+onnxruntime peer (2 threads)": fastapi_ort,
        "sentence-transformers+fastapi peer (2 threads)": st_fastapi,
    }
    if infinity:
        table["infinity-emb 0.0.78 (torch)"] = infinity_emb
    if neighbour:
        table = {f"{k} + busy neighbour": v for k, v in table.items()
                 if k.startswith("vllm-srun") and "batching" not in k}
    return table


def round_trips(url: str, n: int) -> dict[str, float]:
    """p50 of SHORT and of /health with a minimal blocking keep-alive client, so the
    client's own cost stays small."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"input": SHORT, "model": MODEL}).encode()

    def times_ms(method: str, path: str, payload: bytes | None) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            conn.request(method, path, body=payload,
                         headers={"content-type": "application/json"})
            conn.getresponse().read()
            times.append((time.perf_counter() - start) * 1000)
        return times

    try:
        times_ms("POST", "/v1/embeddings", body)[:1]  # warm
        before = forward_totals(url)
        short = times_ms("POST", "/v1/embeddings", body)
        after = forward_totals(url)
        health = times_ms("GET", "/health", None)
    finally:
        conn.close()
    out = {"short_p50_ms": float(np.median(short)), "health_p50_ms": float(np.median(health))}
    if before is not None and after is not None and after[1] > before[1]:
        server_forward_ms = 1000 * (after[0] - before[0]) / (after[1] - before[1])
        out["short_mean_ms"] = float(np.mean(short))
        out["server_forward_mean_ms"] = server_forward_ms
    return out


def forward_totals(url: str) -> tuple[float, float] | None:
    """(sum of forward seconds, forwards) from a vllm-srun server's /metrics, else None."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    sums = re.findall(r"^vllm_srun_forward_seconds_sum\{[^}]*\} (\S+)$", text, re.M)
    counts = re.findall(r"^vllm_srun_forward_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    if not counts:
        return None
    return sum(map(float, sums)), sum(map(float, counts))


def neighbour_proc() -> subprocess.Popen:
    """A process that keeps one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def http_table(levels: list[int], duration_s: float, infinity: str | None, record: str,
               neighbour: bool = False, quick: bool = False) -> dict:
    corpus = make_texts(20_000, seed=1)
    results: dict[str, dict] = {}
    busy = neighbour_proc() if neighbour else None
    try:
        _drive(levels, duration_s, infinity, record, neighbour, corpus, results, quick)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return results


def _drive(levels, duration_s, infinity, record, neighbour, corpus, results, quick) -> None:
    for name, start in servers(infinity, record, neighbour, quick).items():
        try:
            proc = start()
        except Exception as exc:  # a peer that cannot start is reported, not hidden
            results[name] = {"error": str(exc)}
            continue
        try:
            run_load(proc.url, make_texts(64, seed=99), 4, 0.5 if quick else 1.0, MODEL)  # warm
            per_level = {}
            for i, clients in enumerate(levels):
                part = corpus[i * 4000:(i + 1) * 4000]
                r = run_load(proc.url, part, clients, duration_s, MODEL)
                per_level[clients] = {"rps": r.throughput_rps, "p50_ms": r.pct(50),
                                      "p99_ms": r.pct(99), "requests": r.requests,
                                      "errors": r.errors}
                if clients == 1:
                    per_level["by_range_1_client"] = by_range(part, r.samples)
            per_level.update(round_trips(proc.url, 30 if quick else 1000))
            if "adaptive" in name:
                threads = httpx.get(proc.url + "/v1/threads", timeout=10).json()
                per_level["threads"] = threads["reports"][0]["ranges"]
            results[name] = per_level
        finally:
            proc.stop()


def by_range(texts: list[str], samples) -> dict[str, dict]:
    """Median latency (ms) and count per input-size range (padded tokens, as the tuner
    ranges them) of the answered requests."""
    from vllm_srun.runtime.sizes import range_label
    from vllm_srun.runtime.tokenizer import Tokenizer

    manifest = resolve(MODEL)
    tok = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
    groups: dict[str, list[float]] = {}
    for index, ms in samples:
        n = len(tok.encode([texts[index]], truncate=True)[0])
        groups.setdefault(range_label(n), []).append(ms)
    return {k: {"median_ms": float(np.median(v)), "n": len(v)} for k, v in groups.items()}


def oracle_lines(http: dict, fixed: list[str], learned: list[str]) -> list[str]:
    """The per-range oracle: for each range, the best fixed-count server's median at one
    client; a server's score is oracle time / its time over the same traffic mix."""
    ranges = [http[f]["by_range_1_client"] for f in fixed if "by_range_1_client" in
              http.get(f, {})]
    if len(ranges) < 2:
        return []
    keys = sorted(set.intersection(*(set(r) for r in ranges)), key=lambda k: int(k.split("-")[0]))
    weight = {k: ranges[0][k]["n"] for k in keys}
    oracle = {k: min(r[k]["median_ms"] for r in ranges) for k in keys}
    total = sum(weight[k] * oracle[k] for k in keys)
    out = ["", "## Learned counts against the per-range oracle (1 client, mixed sizes)", "",
           "Oracle: for each size range, the best of the fixed-count servers "
           f"({', '.join(fixed)}); score = oracle time / server time over the same mix "
           "(1.00 = as fast as the oracle).", "",
           "| server | " + " | ".join(f"{k} ms" for k in keys) + " | score |",
           "|---|" + "---|" * (len(keys) + 1),
           "| oracle | " + " | ".join(f"{oracle[k]:.2f}" for k in keys) + " | 1.00 |"]
    for name in fixed + learned:
        r = http.get(name, {}).get("by_range_1_client")
        if not r or any(k not in r for k in keys):
            continue
        score = total / sum(weight[k] * r[k]["median_ms"] for k in keys)
        out.append(f"| {name} | " + " | ".join(f"{r[k]['median_ms']:.2f}" for k in keys)
                   + f" | {score:.2f} |")
    return out


def _fmt(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _row(name: str, res: dict, levels: list[int]) -> str:
    if "error" in res:
        return f"| {name} | could not run: {res['error'][:120]} |"
    cells = [f"{res[c]['rps']:.0f}, {_fmt(res[c]['p50_ms'])}, {_fmt(res[c]['p99_ms'])}"
             + (f" ({res[c]['errors']} errors)" if res[c]["errors"] else "") for c in levels]
    return f"| {name} | " + " | ".join(cells) + " |"


def _learned_lines(http: dict) -> list[str]:
    """Per size range, as the adaptive servers measured it with shadow passes (same batches
    at every count, idle worker): median ms per count, learned count, speed-up, state."""
    out = []
    for name, res in http.items():
        if "threads" not in res:
            continue
        out += ["", f"{name}: per range after the learning phase (shadow-pass medians)", "",
                "| padded tokens | 1 thr ms (n) | 2 thr ms (n) | learned | speed-up vs "
                "configured | state |", "|---|---|---|---|---|---|"]
        for r in res["threads"]:
            cells = [f"{c['median_ms']:.2f} ({c['samples']})" if c["samples"] else "-"
                     for c in (r["counts"].get("1", {"samples": 0}),
                               r["counts"].get("2", {"samples": 0}))]
            up = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            out.append(f"| {r['size_range']} | {cells[0]} | {cells[1]} | "
                       f"{r['learned_threads'] or '-'} | {up} | {r['state']} |")
    return out


def report(fwd: list[dict], http: dict, busy: dict, levels: list[int], counts: list[int],
           overhead: dict, args: argparse.Namespace) -> str:
    lines = ["# vllm-srun benchmark report", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"CPU budget {cpu_budget()}; Python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Command: `python -m bench.run"
             f"{' --quick' if args.quick else ''}`.", "",
             "## Forward time per input size and thread count (L6, batch 1, ms: "
             "median [min-max])", "",
             "| backend | tokens | " + " | ".join(f"{n} thr" for n in counts)
             + f" | {counts[-1]} thr / 1 thr |",
             "|---|---|" + "---|" * (len(counts) + 1)]
    for row in fwd:
        cells = []
        for n in counts:
            t = row["ms"][n]
            cells.append(f"{_fmt(np.median(t))} [{_fmt(min(t))}-{_fmt(max(t))}]")
        ratio = np.median(row["ms"][counts[-1]]) / np.median(row["ms"][1])
        lines.append(f"| {row['backend']} | {row['tokens']} | " + " | ".join(cells)
                     + f" | {ratio:.2f} |")
    lines += ["", "## HTTP: throughput (req/s) and latency (ms) by concurrent clients", "",
              "Each request carries one text from a lognormal length distribution (median ~60 "
              "characters, tail to 3000), all unique; same load generator for every server.", "",
              "| server | " + " | ".join(f"{c} clients: req/s, p50, p99" for c in levels) + " |",
              "|---|" + "---|" * len(levels)]
    lines += [_row(name, res, levels) for name, res in http.items()]
    ours = http.get("vllm-srun (default threads)", {})
    for top in sorted({16, levels[-1]} & set(levels)):
        lines += ["", f"## Ratios: throughput at {top} clients, p50 at 1 client", ""]
        for name, res in http.items():
            if "error" in res or name == "vllm-srun (default threads)" or "error" in ours:
                continue
            lines.append(f"- vllm-srun (default) / {name}: throughput "
                         f"{ours[top]['rps'] / res[top]['rps']:.2f}x, p50 at 1 client "
                         f"{ours[levels[0]]['p50_ms'] / res[levels[0]]['p50_ms']:.2f}x")
    lines += _learned_lines(http)
    fixed = ["vllm-srun (default threads)", "vllm-srun (2 threads)"]
    learned = [k for k in http if "adaptive" in k]
    lines += oracle_lines(http, fixed, learned)
    if busy:
        lines += ["", "## The same with a neighbour process keeping one core busy", "",
                  "| server | " + " | ".join(f"{c} clients: req/s, p50, p99" for c in levels)
                  + " |", "|---|" + "---|" * len(levels)]
        lines += [_row(name, res, levels) for name, res in busy.items()]
        lines += _learned_lines(busy)
        lines += oracle_lines(busy, [f"{f} + busy neighbour" for f in fixed],
                              [k for k in busy if "adaptive" in k])
    lines += ["", "## Front-end overhead (short input, 1 client)", "",
              f"- end-to-end p50 {overhead['e2e_p50_ms']:.2f} ms, forward p50 "
              f"{overhead['forward_p50_ms']:.2f} ms (same text, same count, in-process), "
              f"difference {overhead['overhead_ms']:.2f} ms. Measured on the same requests: "
              f"mean end-to-end {overhead['short_mean_ms']:.2f} ms − mean forward inside the "
              f"server {overhead['server_forward_mean_ms']:.2f} ms (from its /metrics) = "
              f"**{overhead['short_mean_ms'] - overhead['server_forward_mean_ms']:.2f} ms**"
              f"; the HTTP round trip of "
              f"`GET /health` on the same connection is {overhead['health_p50_ms']:.2f} ms "
              "(client, loopback and server together). Client: one blocking keep-alive "
              "connection (http.client)."]
    return "\n".join(lines) + "\n"


def plots(out: Path, fwd: list[dict], http: dict, levels: list[int]) -> list[str]:
    """PNG plots beside the report; returns the Markdown lines that show them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, backend in zip(axes, ("onnxruntime", "torch"), strict=True):
        rows = [r for r in fwd if r["backend"] == backend]
        for n in rows[0]["ms"] if rows else []:
            ax.plot([r["tokens"] for r in rows], [np.median(r["ms"][n]) for r in rows],
                    marker="o", label=f"{n} thread(s)")
        ax.set(xscale="log", yscale="log", xlabel="tokens (batch 1)", ylabel="forward ms",
               title=backend)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "forward.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, res in http.items():
        if "error" in res:
            continue
        axes[0].plot(levels, [res[c]["rps"] for c in levels], marker="o", label=name)
        axes[1].plot(levels, [res[c]["p99_ms"] for c in levels], marker="o", label=name)
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="req/s", title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="p99 ms",
                title="tail latency")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "http.png", dpi=110)
    plt.close(fig)
    return ["", "## Plots", "", "![forward time](forward.png)", "", "![HTTP](http.png)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short run (CI-sized)")
    parser.add_argument("--out", default="bench/out", help="folder for report.md")
    parser.add_argument("--infinity", default=os.environ.get("VLLM_SRUN_BENCH_INFINITY"),
                        help="path of an infinity_emb executable in its own venv")
    args = parser.parse_args(argv)
    global LEARN_S
    LEARN_S = 4.0 if args.quick else LEARN_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = sorted({1, 2, cpu_budget()})
    sizes = [3, 64, 256] if args.quick else [3, 8, 16, 32, 64, 128, 256]
    fwd = forward_table(sizes, counts, 3 if args.quick else 30)
    levels = [1, 16] if args.quick else [1, 4, 16, 64]
    record = str(out / "bench-record.sqlite")
    for suffix in ("", "-wal", "-shm"):
        Path(record + suffix).unlink(missing_ok=True)
    # the voucher mode 2 needs; quick: a small sweep (mode 2 then serves learned counts only
    # for those shapes), else every shape a CPU worker can run (minutes)
    small = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--max-tokens", "64"] \
        if args.quick else []
    subprocess.run([sys.executable, "-m", "vllm_srun.server", "threads", "verify", MODEL,
                    "--threads", "1", "--max-threads", "2", "--record", record, *small],
                   check=True, capture_output=True)
    duration = 1.5 if args.quick else 8.0
    http = http_table(levels, duration, args.infinity, record, quick=args.quick)
    busy = {} if args.quick else http_table(levels, duration, None, record, neighbour=True)
    default = http.get("vllm-srun (default threads)", {})
    short_fwd = short_forward_ms(50 if args.quick else 300)
    nan = float("nan")
    overhead = {"e2e_p50_ms": default.get("short_p50_ms", nan),
                "health_p50_ms": default.get("health_p50_ms", nan),
                "short_mean_ms": default.get("short_mean_ms", nan),
                "server_forward_mean_ms": default.get("server_forward_mean_ms", nan),
                "forward_p50_ms": short_fwd}
    overhead["overhead_ms"] = overhead["e2e_p50_ms"] - overhead["forward_p50_ms"]
    pool = run_pool(args.quick)
    (out / "results.json").write_text(json.dumps(
        {"forward": fwd, "http": http, "busy_neighbour": busy, "overhead": overhead,
         "pool": pool}, indent=1, default=float))
    text = report(fwd, http, busy, levels, counts, overhead, args)
    text += "\n".join(pool_lines(pool) + plots(out, fwd, http, levels)) + "\n"
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
