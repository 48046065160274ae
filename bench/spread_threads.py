"""A torch forward at 2 threads handed to a lane, with its threads held on distinct CPUs
(``runtime.placement``, the default) and left to the kernel (``VLLM_SRUN_CPU_SPREAD_THREADS=0``),
side by side:

    python -m bench.spread_threads [--rounds 10] [--backend torch] [--dtype bfloat16]
                                   [--out bench/results/spread_threads.json]
    python -m bench.spread_threads --http [--rounds 10] [--seconds 6] [--dtype bfloat16]

Three worker-like processes (all-MiniLM-L6-v2): spreading on, on again (the null check) and
off. Each keeps an engine-like thread at 1 thread, as a mode 2 worker configured at 1 does,
and serves 2 threads on the context's lane, as mode 2 serves a learned or explored count.
Per round, in turn (the order rotates), each times its 2-thread forwards at each shape after
three patterns: back to back (the lane's team just ran), after three 1-thread forwards (mode 2
between counts), after a 200 ms pause (traffic with gaps; a shadow pass after a pause). The
figure per process and round is the median of its forwards; the ratios (off / on, on again /
on) are paired per round, with a bootstrap 95% interval. Read ratios, not absolute times.

``--http``: three ``vllm-srun serve --backend torch --threads 2`` servers (the engine thread
leads the team itself; no lane), spreading on, on again and off, with the adaptive benches'
mixed bodies and batch limits; per round and in turn, wrk at 16 and at 1 connection, and at
1 connection pausing 200 ms (exponential) before each request. Figures: req/s (16 and 1),
mean latency (with pauses); ratios paired per round as above.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.adaptive_learning import rotated
from bench.precision import host
from bench.stats import median_interval, paired_ratios

MODEL = "all-MiniLM-L6-v2"
SHAPES = ((1, 128), (4, 64), (8, 48), (2, 192))  # rows x tokens: 128 to 384 padded tokens
PATTERNS = ("back to back", "after three 1-thread forwards", "after a 200 ms pause")
PROCESSES = {"on": "1", "on again": "1", "off": "0"}


def _child(conn, spread: str, backend: str, dtype: str, per_pattern: int) -> None:
    """One process: load, then answer each shape with its patterns' forward times (ms)."""
    os.environ["VLLM_SRUN_CPU_SPREAD_THREADS"] = spread
    import numpy as np

    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.threads import ThreadContext, thread_context

    model = load_backend(resolve(MODEL), backend, precision=dtype)
    rng = np.random.default_rng(0)
    context = thread_context()

    def timed(batch, n: int) -> float:
        start = time.perf_counter()
        if n == 1:
            model.forward(batch, 1)  # inline on the engine-like thread
        else:
            context.run(n, lambda: model.forward(batch, n))
        return (time.perf_counter() - start) * 1000

    def serve() -> None:
        ThreadContext.adopt(1)
        while (shape := conn.recv()) is not None:
            rows, tokens = shape
            batch = pad([list(rng.integers(1000, 2000, tokens)) for _ in range(rows)])
            for n in (1, 2, 1, 2):
                timed(batch, n)
            got: dict[str, list[float]] = {p: [] for p in PATTERNS}
            for _ in range(per_pattern):
                timed(batch, 2)
                got[PATTERNS[0]].append(timed(batch, 2))
                for _ in range(3):
                    timed(batch, 1)
                got[PATTERNS[1]].append(timed(batch, 2))
                time.sleep(0.2)
                got[PATTERNS[2]].append(timed(batch, 2))
            conn.send({p: statistics.median(v) for p, v in got.items()})

    engine = threading.Thread(target=serve, name="engine")  # not the main thread (its name
    engine.start()  # is the process's): lanes and adopted threads are named, their teams too
    conn.send("ready")
    engine.join()


HTTP_LEVELS = {"16 connections, req/s": (16, None, "rps"), "1 connection, req/s": (1, None, "rps"),
               "1 connection pausing 200 ms, mean ms": (1, 200.0, "mean_ms")}


def http(a: argparse.Namespace) -> dict:
    """The ``--http`` bench (see the module docstring): figures[server][level] per round."""
    from bench.adaptive_wrk import Server, batch_limits, lua, wrk

    tmp = Path(tempfile.mkdtemp(prefix="spread-"))
    scripts = {}
    for level, (_, think, _) in HTTP_LEVELS.items():
        scripts[level] = tmp / f"{len(scripts)}.lua"
        scripts[level].write_text(lua(MODEL, think_ms=think))
    flags = [*batch_limits(), "--backend", "torch", "--dtype", a.dtype, "--threads", "2",
             "--cache-entries", "0"]
    figures = {n: {lv: [] for lv in HTTP_LEVELS} for n in PROCESSES}
    servers = {}
    try:
        for name, spread in PROCESSES.items():
            servers[name] = Server(MODEL, flags, {"VLLM_SRUN_CPU_SPREAD_THREADS": spread})
        for rnd in range(a.rounds):
            for level, (conns, _, key) in HTTP_LEVELS.items():
                for name in rotated(list(servers), rnd):
                    got = wrk(servers[name].url, str(scripts[level]), conns, a.seconds,
                              seed=1000 * conns + rnd)
                    figures[name][level].append(got[key])
            print(f"round {rnd + 1}/{a.rounds}", flush=True)
    finally:
        for server in servers.values():
            server.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spread_threads")
    p.add_argument("--http", action="store_true", help="fixed 2-thread servers over HTTP")
    p.add_argument("--seconds", type=float, default=6.0, help="--http: per level and round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-pattern", type=int, default=5, help="forwards per pattern and round")
    p.add_argument("--backend", choices=("torch",), default="torch")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--out", default="bench/results/spread_threads.json")
    a = p.parse_args(argv)
    if a.rounds < 2 or a.per_pattern < 1:
        raise SystemExit("--rounds must be >= 2 and --per-pattern >= 1")
    if a.http:
        figures = http(a)
        lines = [f"torch {a.dtype}, `--threads 2` over HTTP, {a.rounds} rounds; median "
                 "(spreading on) and paired ratios with 95% intervals", "",
                 "| level | on | off | off / on | on again / on (null) |", "|---|---|---|---|---|"]
        for level in HTTP_LEVELS:
            on, off, null = (figures[n][level] for n in ("on", "off", "on again"))
            lines.append(f"| {level} | {statistics.median(on):.1f} | {statistics.median(off):.1f}"
                         f" | {median_interval(paired_ratios(off, on)).text()} | "
                         f"{median_interval(paired_ratios(null, on)).text()} |")
        return _write(a, figures, lines)
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for name, spread in PROCESSES.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, spread, a.backend, a.dtype,
                                                a.per_pattern), daemon=True)
        proc.start()
        procs.append(proc)
        pipes[name] = parent
    for conn in pipes.values():
        if conn.recv() != "ready":
            raise SystemExit("a process failed to start")
    # figures[name][shape][pattern] = one median per round
    figures = {n: {f"{r}x{t}": {pt: [] for pt in PATTERNS} for r, t in SHAPES} for n in pipes}
    try:
        for rnd in range(a.rounds):
            for name in rotated(list(pipes), rnd):
                for rows, tokens in SHAPES:
                    pipes[name].send((rows, tokens))
                    for pt, ms in pipes[name].recv().items():
                        figures[name][f"{rows}x{tokens}"][pt].append(ms)
            print(f"round {rnd + 1}/{a.rounds}", flush=True)
    finally:
        for conn in pipes.values():
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)
    lines = [f"torch {a.dtype}, 2 threads on a lane, {a.rounds} rounds; median ms (spreading "
             "on) and paired ratios with 95% intervals", "",
             "| shape | pattern | on: ms | off: ms | off / on | on again / on (null) |",
             "|---|---|---|---|---|---|"]
    for shape in figures["on"]:
        for pt in PATTERNS:
            on, off, null = (figures[n][shape][pt] for n in ("on", "off", "on again"))
            lines.append(f"| {shape} | {pt} | {statistics.median(on):.1f} | "
                         f"{statistics.median(off):.1f} | "
                         f"{median_interval(paired_ratios(off, on)).text()} | "
                         f"{median_interval(paired_ratios(null, on)).text()} |")
    return _write(a, figures, lines)


def _write(a: argparse.Namespace, figures: dict, lines: list[str]) -> int:
    print("\n".join(lines))
    Path(a.out).write_text(json.dumps({"args": vars(a), "host": host(), "figures": figures,
                                       "report": lines}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
