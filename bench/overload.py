"""Overload goodput (issue 11 item 6), measured with wrk:

    python -m bench.overload [--duration 15] [--out DIR]

One ``vllm-srun serve`` (the built-in default model, result cache off so every request is a
forward). First its capacity: 16 closed-loop wrk clients, under the admission limit of 32.
Then ten times a worker's admission limit: 320 wrk clients that ignore Retry-After and send
again the moment they are refused. Goodput = answered requests per second during the flood;
the target is >= 80% of capacity with the 429s' p50 <= 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench import wrk
from bench.run import Proc, free_port

MODEL = "all-MiniLM-L6-v2"


def start_server(extra: list[str]) -> Proc:
    port = free_port()
    return Proc([sys.executable, "-m", "vllm_srun.server", "serve", MODEL, "--port",
                 str(port), "--cache-entries", "0", "--log-level", "warning", *extra],
                f"http://127.0.0.1:{port}")


def measure(duration_s: float, extra: list[str]) -> dict:
    proc = start_server(extra)
    try:
        wrk.run(proc.url, 4, 2)  # warm
        capacity = wrk.run(proc.url, 16, duration_s)
        time.sleep(1)
        flood = wrk.run(proc.url, 320, duration_s)
    finally:
        proc.stop()
    return {"flags": extra, "capacity_rps": capacity.goodput_rps,
            "capacity_p50_ms": capacity.p50_ms,
            "flood_goodput_rps": flood.goodput_rps,
            "flood_goodput_share": flood.goodput_rps / capacity.goodput_rps,
            "flood_refusals_rps": flood.refusals_rps,
            "flood_429_share": flood.overloaded / max(1, flood.ok + flood.overloaded
                                                      + flood.other),
            "flood_p50_ms": flood.p50_ms, "flood_p99_ms": flood.p99_ms,
            "flood_other_errors": flood.other}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("flags", nargs="*", help="extra flags for vllm-srun serve")
    args = parser.parse_args()
    if not wrk.available():
        print("bench.overload needs wrk: apt-get install -y wrk", file=sys.stderr)
        return 2
    result = measure(args.duration, args.flags)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "overload.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
