"""Where a server's engine spends its served forwards under 16 connections: ``python -m
bench.engine_split [--settle 100] [--rounds 6] [--seconds 6] [--backend torch] [--dtype
bfloat16] [--voucher PATH] [--out FILE]``.

Two servers over the adaptive bench's batch limits, result cache off: mode 2 (configured 1,
a copy of a vouched record, settled by ``--settle`` seconds of 16 connections) and a fixed
``--threads 2``. Each loads ``bench/engine_split_site`` (``PYTHONPATH``), which times, on its
scheduler thread, each served forward's whole turn, the forward itself, the threads policy's
two calls, padding, delivery, and how long a forward handed to another count's lane waited
for that lane to start it. Rounds of ``--seconds`` of wrk at 16 connections alternate between
the two; printed per server: req/s (median of rounds), forwards, and each part in us per
forward and as a share of the wall time measured.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.adaptive_wrk import LEARNING, Server, batch_limits, lua, verify, wrk

MODEL = "all-MiniLM-L6-v2"
SITE = str(Path(__file__).with_name("engine_split_site"))
PARTS = ("serve_s", "run_s", "forward_s", "lane_wait_s", "policy_s", "deliver_s", "pad_s")


def totals(prefix: str) -> dict[str, float]:
    time.sleep(0.7)  # the probe writes twice a second
    out: dict[str, float] = {}
    for path in glob.glob(f"{prefix}-*.json"):
        for k, v in json.loads(Path(path).read_text()).items():
            out[k] = out.get(k, 0) + v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_split")
    p.add_argument("--settle", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--backend", choices=("onnxruntime", "torch"), default="torch")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="bfloat16")
    p.add_argument("--voucher", help="a record `threads verify` vouched for over the same "
                                     "batch limits, backend and precision (copied, not changed)")
    p.add_argument("--out", default="bench/results/engine_split.json")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.seconds < 1 or a.settle < 0:
        raise SystemExit("--rounds and --seconds must be >= 1, --settle >= 0")
    if a.voucher and not Path(a.voucher).is_file():
        raise SystemExit(f"--voucher {a.voucher}: no such file")
    limits = [*batch_limits(), "--backend", a.backend, "--dtype", a.dtype, "--cache-entries",
              "0"]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "mix.lua"
        script.write_text(lua(MODEL))
        record = Path(tmp) / "record.sqlite"
        if a.voucher:
            shutil.copy(a.voucher, record)
        else:
            verify(MODEL, str(record), limits)
        prefix = {n: f"{tmp}/split-{n}" for n in ("mode 2", "fixed 2")}
        env = {n: {"VLLM_SRUN_ENGINE_SPLIT": prefix[n], "PYTHONPATH": SITE} for n in prefix}
        servers = {"mode 2": Server(MODEL, [*limits, "--record", str(record)],
                                    {**env["mode 2"], LEARNING: "2"}),
                   "fixed 2": Server(MODEL, [*limits, "--threads", "2"], env["fixed 2"])}
        try:
            end = time.monotonic() + a.settle
            while (left := end - time.monotonic()) > 1:
                wrk(servers["mode 2"].url, str(script), 16, min(20.0, left))
            wrk(servers["fixed 2"].url, str(script), 16, 8)
            learned = {r["size_range"]: r["served_threads"]
                       for r in servers["mode 2"].threads()["ranges"]}
            rps = {n: [] for n in servers}
            measured = {n: dict.fromkeys((*PARTS, "forwards", "handed", "wall_s"), 0.0)
                        for n in servers}
            for k in range(a.rounds):
                for n in (list(servers) if k % 2 == 0 else list(servers)[::-1]):
                    before, began = totals(prefix[n]), time.monotonic()
                    rps[n].append(wrk(servers[n].url, str(script), 16, a.seconds,
                                      seed=1000 + k)["rps"])
                    wall = time.monotonic() - began
                    after = totals(prefix[n])
                    for key in after:
                        measured[n][key] += after[key] - before.get(key, 0)
                    measured[n]["wall_s"] += wall
        finally:
            for server in servers.values():
                server.close()
    result = {"settled_served_threads": learned, "servers": {}}
    for n, m in measured.items():
        f = max(1.0, m["forwards"])
        result["servers"][n] = {
            "rps_median": statistics.median(rps[n]), "rps": rps[n],
            "forwards": m["forwards"], "handed_to_a_lane": m["handed"],
            "us_per_forward": {k: round(1e6 * m[k] / f, 1) for k in PARTS},
            "share_of_wall": {k: round(m[k] / m["wall_s"], 4) for k in PARTS}}
        print(f"{n}: {statistics.median(rps[n]):.1f} req/s, {m['forwards']:.0f} forwards, "
              f"{m['handed']:.0f} handed to a lane")
        for k in PARTS:
            print(f"  {k:12s} {1e6 * m[k] / f:9.1f} us/forward {100 * m[k] / m['wall_s']:6.1f}%")
    print(f"mode 2 settled at: {learned}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
