"""What a fresh mode 2 learns from one pattern of traffic: ``python -m bench.mode2_learned
[--traffic bursts|steady] [--seconds 90] [--backend torch] [--dtype bfloat16]
[--voucher PATH] [--out FILE]``.

One ``vllm-srun serve`` in mode 2 with a copy of a record that ``threads verify`` vouched for
over the adaptive bench's batch limits (``--voucher``; without one the sweep runs first, into
a temporary record), result cache off. ``bursts``: the adaptive bench's learning phase (11
bursts of 4 s, the first third at one connection and the rest at 16, a pause after each),
then ``--seconds`` of 16 connections; ``steady``: ``--seconds`` of 16 connections from the
first second. Printed: req/s of the last run, and per padded-token range the count served and
learned with each count's median served time and samples, as ``/v1/threads`` reports them.
Read beside ``bench.served_by_range`` (what each count's forwards cost under 16 connections).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.adaptive_wrk import LEARNING, Server, batch_limits, learn, lua, verify, wrk

MODEL = "all-MiniLM-L6-v2"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mode2_learned")
    p.add_argument("--traffic", choices=("bursts", "steady"), default="bursts")
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--backend", choices=("onnxruntime", "torch"), default="torch")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="bfloat16")
    p.add_argument("--voucher", help="a record `threads verify` vouched for over the same "
                                     "batch limits, backend and precision (copied, not changed)")
    p.add_argument("--out", default="bench/results/mode2_learned.json")
    a = p.parse_args(argv)
    if a.seconds < 1:
        raise SystemExit("--seconds must be >= 1")
    if a.voucher and not Path(a.voucher).is_file():
        raise SystemExit(f"--voucher: no such file {a.voucher!r}")
    limits = [*batch_limits(), "--backend", a.backend, "--dtype", a.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.sqlite"
        if a.voucher:
            shutil.copy(a.voucher, record)
        else:
            verify(MODEL, str(record), limits)
        script = Path(tmp) / "mix.lua"
        script.write_text(lua(MODEL))
        with Server(MODEL, [*limits, "--cache-entries", "0", "--record", str(record)],
                    {LEARNING: "2"}) as server:
            if a.traffic == "bursts":
                learn(server.url, str(script), 11)
            got = wrk(server.url, str(script), 16, a.seconds, seed=1)
            report = server.threads()
    lines = [f"{a.traffic}: {got['rps']:.1f} req/s over the last {a.seconds:.0f} s",
             "| padded tokens | served | learned | state | 1 thr: median ms (samples) | "
             "2 thr: median ms (samples) |", "|---|---|---|---|---|---|"]
    for r in report["ranges"]:
        cells = [f"{c['median_ms']:.1f} ({c['samples']})" if c["median_ms"] is not None
                 else "-" for c in r["counts"].values()]
        lines.append(f"| {r['size_range']} | {r['served_threads']} | {r['learned_threads']} | "
                     f"{r['state']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    Path(a.out).write_text(json.dumps({"args": vars(a), "wrk": got, "threads": report,
                                       "report": lines}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
