"""torch bfloat16 over HTTP at 1 and 2 threads, and at 2 threads with each OpenMP wait
policy, side by side: does a 2-thread torch worker lose to a 1-thread one on a small host,
and does the OpenMP threads' waiting (spinning or sleeping between forwards) explain it?

    python -m bench.torch_wait_policy [--rounds 6] [--seconds 5] [--dtype bfloat16]
                                      [--out bench/results/torch_wait_policy.json]

Four ``vllm-srun serve --backend torch`` servers up at once (all-MiniLM-L6-v2, the same batch
limits): 1 thread, 2 threads, 2 threads with ``OMP_WAIT_POLICY=PASSIVE`` and with ``ACTIVE``
(read by torch's OpenMP runtime when the worker imports torch). Per round, wrk at 1 and at 16
closed-loop connections with the mixed bodies of ``bench.adaptive_wrk``, each server in turn
(the order rotates, backwards every other round) with the round's seed; the ratio to 1 thread
is paired per round. One run on a shared host: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.adaptive_learning import rotated
from bench.adaptive_wrk import Server, lua, wrk
from bench.precision import host

MODEL = "all-MiniLM-L6-v2"
SERVERS = {"1 thread": ([], {}), "2 threads": (["--threads", "2"], {}),
           "2 threads, PASSIVE": (["--threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
           "2 threads, ACTIVE": (["--threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"})}
LEVELS = (1, 16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torch_wait_policy")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "torch_wait_policy.json"))
    a = p.parse_args(argv)
    if a.rounds < 1 or a.seconds <= 0:
        p.error("--rounds must be >= 1 and --seconds > 0")
    base = ["--backend", "torch", "--dtype", a.dtype, "--max-num-seqs", "32",
            "--max-num-batched-tokens", "512"]
    script = Path(tempfile.mkdtemp(prefix="torch-wait-")) / "mixed.lua"
    script.write_text(lua(MODEL))
    before = host()
    servers: dict[str, Server] = {}
    rps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in LEVELS} for n in SERVERS}
    try:
        for name, (flags, env) in SERVERS.items():
            servers[name] = Server(MODEL, [*flags, *base], env)
        for i in range(a.rounds):
            for c in LEVELS:
                for name in rotated(list(servers), i):
                    rps[name][c].append(wrk(servers[name].url, str(script), c, a.seconds,
                                            seed=1000 * c + i)["rps"])
            print(f"round {i + 1}/{a.rounds}: " + ", ".join(
                f"{n} {rps[n][1][-1]:.0f}/{rps[n][16][-1]:.0f}" for n in servers), flush=True)
    finally:
        for s in servers.values():
            s.close()
    summary = {}
    for c in LEVELS:
        for name in SERVERS:
            ratios = [x / y for x, y in zip(rps[name][c], rps["1 thread"][c], strict=True)]
            summary.setdefault(str(c), {})[name] = {
                "median_rps": statistics.median(rps[name][c]),
                "over_1_thread_median": statistics.median(ratios),
                "over_1_thread_min": min(ratios), "over_1_thread_max": max(ratios)}
            print(f"{c:2} connections  {name:20} {statistics.median(rps[name][c]):7.1f} req/s"
                  f"  / 1 thread, per round: median {statistics.median(ratios):.3f}"
                  f" [{min(ratios):.3f}, {max(ratios):.3f}]")
    Path(a.out).write_text(json.dumps({"host_before": before, "host_after": host(),
                                       "args": vars(a), "rps": rps, "summary": summary},
                                      indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
