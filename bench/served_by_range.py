"""What a served forward costs per padded-token range at each fixed thread count, under one
load: ``python -m bench.served_by_range [--counts 1,2] [--connections 16] [--rounds 6]
[--seconds 8] [--backend torch] [--dtype bfloat16] [--out FILE]``.

One ``vllm-srun serve`` per count (the adaptive bench's batch limits, result cache off), all
up at once and driven in turn by wrk with the mixed bodies of ``bench.adaptive_wrk`` (the
order reversed every other round, one seed per round for all). After each run the served
forwards' count and seconds per ``size_range`` are read from ``/metrics``. Printed per range
and count: forwards and their mean time. It tells what adaptive threads' served samples
should find under that load: a count whose forwards cost less here is the one a range
should learn. Read it beside the throughput of each server, printed per round.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.adaptive_wrk import Server, batch_limits, lua, wrk
from bench.load_trace import forward_totals, since
from bench.precision import host

MODEL = "all-MiniLM-L6-v2"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.served_by_range")
    p.add_argument("--counts", default="1,2")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--backend", choices=("onnxruntime", "torch"), default="torch")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="bfloat16")
    p.add_argument("--out", default="bench/results/served_by_range.json")
    a = p.parse_args(argv)
    try:
        counts = [int(c) for c in a.counts.split(",")]
    except ValueError:
        raise SystemExit(f"--counts: not a list of integers: {a.counts!r}") from None
    if not counts or min(counts) < 1 or a.connections < 1 or a.rounds < 1 or a.seconds < 1:
        raise SystemExit("--counts >= 1 each, --connections >= 1, --rounds >= 1, --seconds >= 1")
    flags = [*batch_limits(), "--cache-entries", "0", "--backend", a.backend, "--dtype", a.dtype]
    before = host()
    totals: dict[int, dict[str, list[float]]] = {n: {} for n in counts}
    rps: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(lua(MODEL))
        script.flush()
        servers = {}
        try:
            for n in counts:
                servers[n] = Server(MODEL, [*flags, "--threads", str(n)], {})
                wrk(servers[n].url, script.name, a.connections, 3, seed=999)  # warm
            for r in range(a.rounds):
                order = counts if r % 2 == 0 else counts[::-1]
                for n in order:
                    start = forward_totals(servers[n].url)
                    rps[n].append(wrk(servers[n].url, script.name, a.connections, a.seconds,
                                      seed=r)["rps"])
                    for rng, t in since(forward_totals(servers[n].url), start).items():
                        f, s = totals[n].get(rng, [0.0, 0.0])
                        totals[n][rng] = [f + t.forwards, s + t.seconds]
                print(f"round {r + 1}: " + ", ".join(f"{n} threads {rps[n][-1]:.1f} req/s"
                                                     for n in counts), flush=True)
        finally:
            for server in servers.values():
                server.close()
    ranges = sorted({r for n in counts for r in totals[n]}, key=lambda r: int(r.split("-")[0]))
    report = ["| padded tokens | " + " | ".join(f"{n} thr: forwards, mean ms" for n in counts)
              + " |", "|---|" + "---|" * len(counts)]
    for rng in ranges:
        cells = []
        for n in counts:
            f, s = totals[n].get(rng, [0.0, 0.0])
            cells.append(f"{int(f)}, {1000 * s / f:.2f}" if f else "-")
        report.append(f"| {rng} | " + " | ".join(cells) + " |")
    print("\n".join(report))
    Path(a.out).write_text(json.dumps({"host_before": before, "host_after": host(),
                                       "args": vars(a), "rps": rps, "ranges": totals,
                                       "report": report}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
