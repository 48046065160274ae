"""Mode 1 out of the box: how soon a server started as a user starts it times every allowed
count and learns one, for each size range its traffic reaches, under open-loop load.

For each load level (a share of the default server's capacity): a fresh host record,
``vllm-srun serve --adaptive-threads learn`` with default flags, Poisson arrivals from the C
open-loop generator (``bench/openloop.c``) at that rate for ``--seconds``, and the server's
report (``GET /v1/threads``) read every ``--poll-s``. Per range: when every allowed count first
had a sample, and the decision's number of samples (or learned with fewer: a count behind
for sure needs no more), and when it first had a learned count.
The target (adaptive threads, out of the box): at 30% and 60% of capacity, every range the
traffic reaches has timing at every allowed count within 2 minutes and a learned count within 5.

Capacity is measured first, on a server with learning off (wrk, 16 connections), unless
``--capacity`` gives it.

    python -m bench.mode1_learning [--shares 0.3,0.6] [--seconds 300] [--capacity RPS]
                                   [--backend torch --dtype bfloat16]

``--backend``/``--dtype`` (default: the server's own, what a user gets) start both the
capacity server and the learning servers with that backend and precision.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

from bench import openloop
from bench.adaptive_wrk import Server, lua
from bench.adaptive_wrk import wrk as run_wrk
from bench.load_trace import write_bodies

MODEL = "all-MiniLM-L6-v2"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TIMED_BY_S, LEARNED_BY_S = 120.0, 300.0  # the target's bounds


def capacity_rps(tmp: Path, flags: list[str]) -> float:
    script = tmp / "load.lua"
    script.write_text(lua(MODEL))
    with Server(MODEL, ["--cache-entries", "0", *flags], ENV) as server:
        run_wrk(server.url, str(script), 1, 3)  # warm
        return float(run_wrk(server.url, str(script), 16, 10)["rps"])


def _firsts(report: dict, at_s: float, seen: dict[str, dict]) -> None:
    """Per range, the first time each milestone held."""
    need = report.get("decision_min_samples") or 1
    for r in report.get("ranges", ()):
        got = seen.setdefault(r["size_range"], {"timed_s": None, "decided_s": None,
                                                 "learned_s": None})
        samples = [c["samples"] for c in r["counts"].values()]
        got["samples"] = dict(zip(r["counts"], samples, strict=True))
        got["state"], got["learned"] = r["state"], r["learned_threads"]
        learned = r["learned_threads"] is not None
        # decided: every count has the samples a decision needs, or the rule needed fewer
        # (a count behind for sure stops at 3; counts past a slower one are not timed)
        for key, held in (("timed_s", min(samples) >= 1 or learned),
                          ("decided_s", min(samples) >= need or learned),
                          ("learned_s", learned)):
            if held and got[key] is None:
                got[key] = at_s


def run_level(tmp: Path, rate: float, seconds: float, poll_s: float, seed: int,
              flags: list[str]) -> dict:
    bodies = write_bodies(tmp / f"bodies-{seed}.jsonl", MODEL, math.ceil(rate * seconds * 1.3)
                          + 50, seed)
    record = tmp / f"record-{seed}.sqlite"
    args = ["--adaptive-threads", "learn", "--record", str(record), "--cache-entries", "0",
            *flags]
    seen: dict[str, dict] = {}
    with Server(MODEL, args, ENV) as server:
        load: dict = {}
        sender = threading.Thread(target=lambda: load.update(openloop.run(
            server.url, bodies, rate, seconds, seed)), daemon=True)
        start = time.monotonic()
        sender.start()
        while sender.is_alive():
            sender.join(poll_s)
            _firsts(server.threads(), time.monotonic() - start, seen)
        report = server.threads()
    return {"rate_rps": rate, "load": load, "ranges": seen, "report": report,
            "load_1min_end": os.getloadavg()[0]}


def verdict(level: dict) -> str:
    ranges = level["ranges"]
    timed = [k for k, v in ranges.items() if v["decided_s"] is not None
             and v["decided_s"] <= TIMED_BY_S]
    learned = [k for k, v in ranges.items() if v["learned_s"] is not None
               and v["learned_s"] <= LEARNED_BY_S]
    return (f"{level['share']:.0%} of capacity ({level['rate_rps']:.1f} req/s): "
            f"{len(timed)}/{len(ranges)} ranges timed at every count within "
            f"{TIMED_BY_S:.0f} s, {len(learned)}/{len(ranges)} learned within "
            f"{LEARNED_BY_S:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mode1_learning")
    parser.add_argument("--shares", default="0.3,0.6")
    parser.add_argument("--seconds", type=float, default=LEARNED_BY_S)
    parser.add_argument("--poll-s", type=float, default=5.0)
    parser.add_argument("--capacity", type=float, default=None, help="req/s (else measured)")
    parser.add_argument("--backend", choices=("onnxruntime", "torch"), default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default=None)
    parser.add_argument("--out", default="bench/results/mode1_learning.json")
    args = parser.parse_args(argv)
    flags = [*(["--backend", args.backend] if args.backend else []),
             *(["--dtype", args.dtype] if args.dtype else [])]
    try:
        shares = [float(x) for x in args.shares.split(",")]
    except ValueError:
        raise SystemExit(f"--shares: comma-separated numbers, got {args.shares!r}") from None
    if not all(0 < s <= 1 for s in shares) or args.seconds <= 0 or args.poll_s <= 0:
        raise SystemExit("--shares within (0, 1], --seconds and --poll-s > 0")
    with tempfile.TemporaryDirectory(prefix="mode1-") as tmp:
        capacity = args.capacity or capacity_rps(Path(tmp), flags)
        levels = []
        for i, share in enumerate(shares):
            level = run_level(Path(tmp), share * capacity, args.seconds, args.poll_s, 1000 + i,
                              flags)
            level["share"] = share
            levels.append(level)
            print(verdict(level), f"(load {level['load_1min_end']:.1f})", flush=True)
    doc = {"model": MODEL, "flags": flags, "capacity_rps": capacity, "levels": levels,
           "verdicts": [verdict(lv) for lv in levels]}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for lv in levels:
        for name, v in sorted(lv["ranges"].items(), key=lambda kv: int(kv[0].split("-")[0])):
            print(f"  {lv['share']:.0%} {name}: timed {v['timed_s']} s, decided "
                  f"{v['decided_s']} s, learned {v['learned_s']} s -> {v['learned']} "
                  f"({v['state']}; samples {v['samples']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
