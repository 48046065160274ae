"""Mode 2 without a sweep under steady load: how fast does a busy worker verify the shapes it
serves, and what does it serve meanwhile?

    python -m bench.mode2_coverage [--seconds 180] [--window 10] [--connections 16]
                                   [--out bench/results/mode2_coverage.json]

A fixed ``--threads 2`` server (the best fixed count on 2 vCPUs) runs four 10-s windows of wrk
at ``--connections``, then a fresh ``--adaptive-threads serve`` server (an empty host record:
no voucher, nothing learned) serves the same load without a pause for ``--seconds``, read
after each window (``GET /v1/threads``: shapes verified, how many of them paid from the
learning share, forwards served at the configured count for want of a verified shape, the
share spent), then fixed 2 four windows again. All-MiniLM-L6-v2, the mixed bodies of
``bench.adaptive_wrk``, the batch limits of ``bench.adaptive_load``. The servers run one after
another (the load is the point: nothing else may give mode 2 idle time), so the ratio to
fixed 2 is not paired; compare runs at two versions by running this at each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.adaptive_wrk import LEARNING, Server, batch_limits, lua, wrk
from bench.precision import host

MODEL = "all-MiniLM-L6-v2"
LIMITS = batch_limits()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mode2_coverage")
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "mode2_coverage.json"))
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.window < 1 or a.connections < 1:
        p.error("--seconds must be > 0, --window >= 1, --connections >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="mode2-coverage-"))
    script = tmp / "mixed.lua"
    script.write_text(lua(MODEL))
    out: dict = {"host_before": host(), "args": vars(a), "fixed_2": [], "mode_2": []}
    seed = 0

    def windows(url: str, k: int) -> list[float]:
        nonlocal seed
        got = []
        for _ in range(k):
            seed += 1
            got.append(wrk(url, str(script), a.connections, a.window, seed=seed)["rps"])
        return got

    with Server(MODEL, ["--threads", "2", *LIMITS], {}) as fixed:
        out["fixed_2"] += windows(fixed.url, 4)
        with Server(MODEL, ["--record", str(tmp / "record.sqlite"), *LIMITS],
                    {LEARNING: "2"}) as mode2:
            t0 = time.monotonic()
            while time.monotonic() - t0 < a.seconds:
                rps = windows(mode2.url, 1)[0]
                rep = mode2.threads()
                learning, voucher = rep.get("learning", {}), rep.get("voucher") or {}
                w = {"t_s": round(time.monotonic() - t0, 1), "rps": rps,
                     "forwards": learning.get("forwards_served"),
                     "uncovered_forwards": rep.get("uncovered_forwards"),
                     "shapes_verified": sum((voucher.get("shapes_verified") or {}).values()),
                     "shapes_verified_paid": learning.get("shapes_verified_paid"),
                     "shapes_verified_in_idle_time": learning.get("shapes_verified_in_idle_time"),
                     "shapes_verified_against_served_answers": learning.get(
                         "shapes_verified_against_served_answers"),
                     "paid_share_of_served": learning.get("paid_share_of_served"),
                     "ranges_serving_learned": sum(r.get("state") == "serving-learned"
                                                   for r in rep.get("ranges", []))}
                out["mode_2"].append(w)
                print(json.dumps(w), flush=True)
        out["fixed_2"] += windows(fixed.url, 4)
    out["host_after"] = host()
    fixed_rps = statistics.median(out["fixed_2"])
    last = [w for w in out["mode_2"] if w["t_s"] > a.seconds - 60]
    prev = out["mode_2"][-len(last) - 1] if len(out["mode_2"]) > len(last) else None
    span = (last[-1]["forwards"] - prev["forwards"]) if prev and prev.get("forwards") is not None \
        else None
    out["summary"] = {
        "fixed_2_median_rps": fixed_rps,
        # of the forwards served in the last minute, those kept at the configured count
        # for want of a verified shape (their range had learned another count)
        "uncovered_share_last_minute": (last[-1]["uncovered_forwards"]
                                        - prev["uncovered_forwards"]) / span if span else None,
        "mode_2_last_minute_over_fixed_2": statistics.fmean(w["rps"] for w in last) / fixed_rps,
        "uncovered_per_s_last_minute": (last[-1]["uncovered_forwards"]
                                        - prev["uncovered_forwards"])
        / (last[-1]["t_s"] - prev["t_s"]) if prev else None,
        "final": out["mode_2"][-1]}
    print(json.dumps(out["summary"], indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
