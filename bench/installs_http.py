"""Two installs of vllm-srun side by side over HTTP: the same servers from an older and a newer
install, in interleaved rounds, with onnxruntime float32 from the newer one beside them.

    python -m bench.installs_http --old OLD_PYTHON [--new NEW_PYTHON] [--rounds 4]
        [--seconds 10] [--set precisions|at-once] [--out bench/results/installs_http.json]

``--old`` / ``--new``: the Python of each install's environment (``--new`` defaults to this
one). Per round, every server alone, one after another in a fixed order: torch bfloat16 and
torch float32 from both installs (1 thread), torch bfloat16 at 2 threads from the newer,
onnxruntime float32 at 1 and 2 threads from the newer; each warmed 3 s, then wrk at 1 and 16
connections with unique mixed bodies (``bench.adaptive_wrk``'s script; one seed per round and
level: every server of a round gets the same bodies). Prints every run, then per server the
median over rounds and the newer over the older per round. ``--set at-once``: instead, from
both installs, torch bfloat16, onnxruntime float32 and int8 with two forwards at once, and
onnxruntime float32 at 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.adaptive_wrk import lua, wrk
from bench.precision import host
from bench.run import Proc, free_port

MODEL = "all-MiniLM-L6-v2"
LEVELS = (1, 16)
SERVERS = (("torch bfloat16", "old", ["--dtype", "bfloat16", "--backend", "torch"]),
           ("torch bfloat16", "new", ["--dtype", "bfloat16", "--backend", "torch"]),
           ("torch bfloat16 2 threads", "new",
            ["--dtype", "bfloat16", "--backend", "torch", "--threads", "2"]),
           ("torch float32", "old", ["--backend", "torch"]),
           ("torch float32", "new", ["--backend", "torch"]),
           ("onnxruntime float32", "new", []),
           ("onnxruntime float32 2 threads", "new", ["--threads", "2"]))
# ``--set at-once``: the configurations that lead at 16 clients, each from both installs
AT_ONCE = tuple((name, which, flags) for name, flags in (
    ("torch bfloat16, 2 forwards at once",
     ["--dtype", "bfloat16", "--backend", "torch", "--concurrent-forwards", "2"]),
    ("onnxruntime float32, 2 forwards at once", ["--concurrent-forwards", "2"]),
    ("onnxruntime int8, 2 forwards at once", ["--dtype", "int8", "--concurrent-forwards", "2"]),
    ("onnxruntime float32 2 threads", ["--threads", "2"])) for which in ("old", "new"))
SETS = {"precisions": SERVERS, "at-once": AT_ONCE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.installs_http")
    p.add_argument("--old", required=True, help="the older install's python")
    p.add_argument("--new", default=sys.executable, help="the newer install's python")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--set", choices=sorted(SETS), default="precisions",
                   help="precisions: the servers above; at-once: the 16-client leaders "
                        "(two forwards at once, float32 --threads 2), each from both installs")
    p.add_argument("--out", default="bench/results/installs_http.json")
    args = p.parse_args(argv)
    servers = SETS[args.set]
    for path in (args.old, args.new):
        if not Path(path).is_file():
            raise SystemExit(f"no such python: {path!r}")
    if args.rounds < 1 or args.seconds < 1:
        raise SystemExit("--rounds must be >= 1 and --seconds >= 1")
    python = {"old": args.old, "new": args.new}
    before = host()
    runs: dict[str, list[dict]] = {f"{name} ({which})": [] for name, which, _ in servers}
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(lua(MODEL))
        script.flush()
        for r in range(args.rounds):
            for name, which, flags in servers:
                port = free_port()
                proc = Proc([python[which], "-m", "vllm_srun.server", "serve", MODEL, "--port",
                             str(port), "--cache-entries", "0", "--log-level", "warning",
                             *flags], f"http://127.0.0.1:{port}", env={"HF_HUB_OFFLINE": "1"})
                try:
                    wrk(proc.url, script.name, 1, 3, seed=100 * r + 99)
                    got = {str(c): wrk(proc.url, script.name, c, args.seconds, seed=100 * r + c)
                           for c in LEVELS}
                finally:
                    proc.stop()
                runs[f"{name} ({which})"].append(got)
                print(r, f"{name} ({which})", " | ".join(
                    f"{c}: {g['rps']:.1f} req/s p50 {g['p50_ms']:.2f} p99 {g['p99_ms']:.1f} "
                    f"failed {g['non_2xx'] + g['errors']}" for c, g in got.items()),
                    f"load {os.getloadavg()[0]:.2f}", flush=True)
    report = []
    for key, got in runs.items():
        report.append(f"{key}: " + "; ".join(
            f"{c} conn {statistics.median(g[c]['rps'] for g in got):.1f} req/s, p50 "
            f"{statistics.median(g[c]['p50_ms'] for g in got):.2f} ms" for c in map(str, LEVELS)))
    for name in dict.fromkeys(n for n, w, _ in servers if w == "old"):
        old, new = runs[f"{name} (old)"], runs[f"{name} (new)"]
        for c in map(str, LEVELS):
            rps = [n[c]["rps"] / o[c]["rps"] for n, o in zip(new, old, strict=True)]
            p50 = [n[c]["p50_ms"] / o[c]["p50_ms"] for n, o in zip(new, old, strict=True)]
            report.append(f"{name}, {c} conn, new / old per round: req/s "
                          f"{', '.join(f'{x:.2f}' for x in rps)}; p50 "
                          f"{', '.join(f'{x:.2f}' for x in p50)}")
    print("\n".join(report))
    Path(args.out).write_text(json.dumps({"host_before": before, "host_after": host(),
                                          "old": args.old, "new": args.new, "runs": runs,
                                          "report": report}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
