"""Adaptive threads under load, over HTTP with wrk: every server alone, one after another, in
one run, with the targets of the adaptive-threads work judged side by side at the end.

    python -m bench.adaptive_load [--model all-MiniLM-L6-v2] [--seconds 12] [--learn-seconds 60]
                                  [--max-num-batched-tokens 512]
                                  [--only levels oracle neighbour phases p99]
                                  [--p99-rounds 6] [--p99-seconds 20]
                                  [--quick] [--voucher PATH]
                                  [--out bench/results/adaptive_load.json]

Servers (``vllm-srun serve``, all with ``--max-num-seqs 32`` and the same
``--max-num-batched-tokens``): fixed 1 thread (the default on this 2-core host: learning
off), fixed 2 threads, mode 1 and mode 2 (``VLLM_SRUN_CPU_ADAPTIVE_THREADS``; counts 1 and 2
on this host), and in ``levels`` a second fixed 1 (``fixed 1 again``: the null check, whose
p99 over fixed 1's is the noise of this run's p99 ratios). Each adaptive server gets a fresh
host record with nothing learned in it (mode 2's is a copy of one record that ``threads
verify`` vouched for over exactly those batch limits: the sweep takes minutes and writes
only the voucher, so it runs once), first learns from bursts of traffic at 1 and at 16
connections with 1 s pauses (``--learn-seconds`` in all), then is measured; what it learned
(``GET /v1/threads``) is printed after its run. Bodies are unique (the result cache never
answers) and mixed: 70% short (~6 words), 25% passages (~40), 5% long (~150). Every server
of a round gets the same requests at the same pace (one wrk seed per round and level: common
random numbers).

Servers of a section are all up at once (the adaptive ones learn one after another while the
others idle) and every level is measured in ``--rounds`` interleaved rounds, each server once
per round in a rotating order, so the shared host's drift between minutes falls on all of
them alike; tables show each server's median over the rounds.

Sections (``--only``):

- ``levels``: capacity = the learning-off server's req/s at 16 closed-loop connections; then
  every server at closed-loop 1 and 16 connections and at Poisson arrivals of 30/60/90% of
  capacity. Poisson is approximate: 64 connections each wait an exponential think time of
  mean 64/rate (wrk's ``delay()``) before each request, but a connection also waits for its
  answer, so the achieved rate sits below the target (both are shown) and arrivals are not
  quite independent of the server.
- ``oracle``: per *length class* alone (short, passage, long), every server at 1
  connection (mean latency, wrk's ``latency.mean``); the oracle's mean is 0.70*min(short) +
  0.25*min(passage) + 0.05*min(long) over fixed 1 and fixed 2, compared with each server's
  class means weighted the same way (oracle/server, 1.0 = as good as always picking the
  better fixed count per class; the mixed run's mean is shown too, but a mix is slower than
  its classes alone, so it is not compared with the oracle). This is a per-length-class
  oracle, not per padded-token range (what the tuner chooses by): a class's requests fall in
  more than one range, so the tuner can beat it.
- ``neighbour``: a CPU hog of one core (``sha256sum /dev/zero``) stopped and continued every
  2 s (on half the time) while fixed 1, fixed 2 and mode 2 (a fresh record, learning with the
  neighbour present) are measured at 16 and at 1 connection.
- ``phases``: fixed 1 and fixed 2 with that neighbour stopped, then running throughout, at
  16 and 1 connection. The per-phase oracle (the better fixed count in each phase, half the
  time each, in req/s) says what following the toggling neighbour could gain over fixed 2
  and, beside the ``neighbour`` section in the same run, how much of it mode 2 got.
- ``p99``: the learning-cost target alone, where its noise is largest: fixed 1, ``fixed 1
  again`` and mode 1 at the three Poisson levels, ``--p99-rounds`` rounds of
  ``--p99-seconds`` (default 6 of 20 s: 120 s per server and level, against ``levels``' 36
  s, so its pooled p99 rests on over three times the slowest requests).

Read the tables as one run on a shared machine: req/s counts every completed response,
non-2xx ones (429 overload, 504 deadline) included and also shown apart; p50/p99/mean are
wrk's over all responses. The targets table is met/missed for this run only, on the medians;
beside it, each target as paired ratios (round by round, against the other server's figure
in the same round: the two ran within a minute of each other) with their median and how
many rounds met the goal, and, for the p99 targets, the ratio of each server's p99 over the
requests of all its rounds pooled (from wrk's 90-100% quantiles per run: an 8-s run's p99
rests on a handful of requests). A noisy host (other jobs, the neighbour) moves fixed counts by
large factors between minutes, so repeat before drawing conclusions. Results go to
``--out`` as JSON (NaN written as null).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

from bench.adaptive_wrk import (
    LEARNING,
    MIX,
    Server,
    learn,
    lua,
    pooled_percentile,
    range_states,
    threads_summary,
    verify,
    wrk,
)

SECTIONS = ("levels", "oracle", "neighbour", "phases", "p99")
POISSON = (0.3, 0.6, 0.9)
POISSON_CONNS = 64
# name, extra flags, learning mode
SERVERS = (("fixed 1", [], None), ("fixed 2", ["--threads", "2"], None),
           ("mode 1", [], "1"), ("mode 2", [], "2"))
# the levels' null check: a second server just like fixed 1, whose p99 over fixed 1's is the
# noise a p99 ratio of this run carries (two such servers differed by up to 21%, pooled over
# four 10-s rounds at 60% of capacity, with the same requests at the same pace)
AGAIN = ("fixed 1 again", [], None)
P99 = " (p99 section)"  # the p99 section's rounds: longer runs, more of them


@contextmanager
def neighbour(period_s: float | None = 2.0):
    """One core's worth of CPU hog, on and off every ``period_s`` (on half the time), or on
    throughout (None)."""
    hog = subprocess.Popen(["sha256sum", "/dev/zero"], stdout=subprocess.DEVNULL)
    stop = threading.Event()

    def toggle() -> None:
        on = True
        while period_s is not None and not stop.wait(period_s):
            on = not on
            hog.send_signal(signal.SIGCONT if on else signal.SIGSTOP)

    toggler = threading.Thread(target=toggle, daemon=True)
    toggler.start()
    try:
        yield
    finally:
        stop.set()
        toggler.join()
        hog.kill()
        hog.wait()


def ratio(a, b) -> float | None:
    return a / b if a is not None and b and math.isfinite(a) and math.isfinite(b) else None


def clean(x):
    """NaN -> None, for strict JSON."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def compact(text: str) -> str:
    """JSON with every list of numbers on one line (each run's tail quantiles: 201 of them)."""
    return re.sub(r"\[\s*([-+\d.eE]+(?:,\s*[-+\d.eE]+)*)\s*\]",
                  lambda m: "[" + ", ".join(m[1].replace(",", " ").split()) + "]", text)


def md(head: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--seconds", type=float, default=12, help="per measured level")
    p.add_argument("--learn-seconds", type=float, default=60, help="learning phase, in all")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level")
    p.add_argument("--p99-rounds", type=int, default=6, help="rounds per level, p99 section")
    p.add_argument("--p99-seconds", type=float, default=20, help="per run, p99 section")
    p.add_argument("--quick", action="store_true", help="smoke pass: 2 s levels, 6 s learning")
    p.add_argument("--voucher", help="a record that `threads verify` vouched for with the same "
                   "model and batch limits: reused if it exists, made there if not (the sweep "
                   "takes minutes)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "adaptive_load.json"))
    args = p.parse_args()
    if args.quick:
        args.seconds, args.learn_seconds, args.rounds = 2, 6, 1
        args.p99_seconds, args.p99_rounds = 2, 1
    if not shutil.which("wrk"):
        sys.exit("wrk (the C HTTP load generator) is not installed: apt-get install wrk")
    if {"neighbour", "phases"} & set(args.only) and not shutil.which("sha256sum"):
        sys.exit("sha256sum (coreutils) is needed for the neighbour section")
    limits = ["--max-num-seqs", "32", "--max-num-batched-tokens",
              str(args.max_num_batched_tokens)]
    tmp = Path(tempfile.mkdtemp(prefix="adaptive-load-"))

    def script(name: str, **kw) -> str:
        path = tmp / f"{name}.lua"
        path.write_text(lua(args.model, **kw))
        return str(path)

    mixed = script("mixed")
    per_class = {name: script(name, mix=((name, 1.0, words),)) for name, _, words in MIX}

    voucher = Path(args.voucher) if args.voucher else tmp / "voucher.sqlite"
    vouched = voucher.with_name(voucher.name + ".ok")  # the sweep finished

    def vouch() -> None:
        """``threads verify`` once (minutes) into a record that holds only the voucher."""
        if not vouched.exists():
            for old in voucher.parent.glob(voucher.name + "*"):  # a failed sweep's leftovers
                old.unlink()
            t0 = time.monotonic()
            print("threads verify ...", end=" ", flush=True)
            verify(args.model, str(voucher), limits)
            vouched.touch()
            print(f"{time.monotonic() - t0:.0f} s", flush=True)

    def start(name: str, flags: list[str], mode: str | None) -> Server:
        if mode is None:
            return Server(args.model, [*flags, *limits], {})
        record = str(tmp / f"{name.replace(' ', '-')}-{time.monotonic_ns()}.sqlite")
        if mode == "2":  # a fresh record: a copy of the verified one, nothing learned yet
            vouch()
            src, dst = sqlite3.connect(voucher), sqlite3.connect(record)
            src.backup(dst)
            src.close()
            dst.close()
        server = Server(args.model, [*flags, "--record", record, *limits], {LEARNING: mode})
        rest = min(5.0, args.learn_seconds / 6)
        bursts = max(2, round((args.learn_seconds - rest) / 5))
        print(f"{name}: learning ({bursts} bursts) ...", flush=True)
        try:
            learn(server.url, mixed, bursts,
                  max(1, round((args.learn_seconds - rest) / bursts - 1)), 1, rest)
        except BaseException:
            server.close()
            raise
        return server

    def measure(name: str, level: str, server: Server, path: str, conns: int,
                target: float | None = None, seed: int | None = None,
                seconds: float | None = None) -> dict:
        before = report(server) if name.startswith("mode") else None
        r = wrk(server.url, path, conns, seconds or args.seconds, seed)
        if before is not None and (after := report(server)).get("learning"):
            # what the tuner did during this run alone (the report's counters are totals),
            # and each range's state as the run began and as it ended (a low round: were
            # its ranges still exploring, or learned but not yet past their window?)
            was = before.get("learning") or {}
            r["learning"] = {k: v - was.get(k, 0) for k, v in after["learning"].items()
                             if isinstance(v, int)}
            r["ranges"] = {"before": range_states(before), "after": range_states(after)}
        if target is not None:
            r["target_rps"] = target
        print(f"  {name:8} {level:12} {r['rps']:7.1f} req/s"
              + (f" (target {target:6.1f})" if target is not None else " " * 17)
              + f"  p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f}  mean {r['mean_ms']:7.2f} ms"
              f"  non-2xx {r['non_2xx']}  errors {r['errors']}"
              + (f"  froze {r['learning'].get('served_forwards_that_froze_a_shadow', 0)}"
                 f" shadows {r['learning'].get('shadow_comparisons', 0)}"
                 if "learning" in r else ""), flush=True)
        return r

    def report(server: Server) -> dict:
        """``GET /v1/threads``, or {} where it cannot be read."""
        try:
            return server.threads()
        except Exception:  # noqa: BLE001 (a bonus: the run's figures stand without it)
            return {}

    out = {"meta": {**vars(args), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "capacity_rps": None, "levels": {}, "oracle": {}, "neighbour": {}, "phases": {},
           "phase_oracle": {}, "threads": {}, "rounds": {}, "failures": {}}
    levels, nb, failures = out["levels"], out["neighbour"], out["failures"]
    phases = out["phases"]
    class_ms: dict[str, dict[str, float]] = {}
    mix_ms: dict[str, float] = {}

    def interleaved(servers: dict[str, Server], level: str, path: str, conns: int,
                    table: dict, target: float | None = None, section: str = "",
                    rounds: int | None = None, seconds: float | None = None) -> None:
        """``--rounds`` rounds, each server once per round (the order rotates, and runs
        backwards every other round, so no server always follows the same one: an adaptive
        server learning once its own run ends slows whichever comes next), so a drift of
        the shared host falls on every server alike; every server of a round gets the same
        requests at the same pace (one wrk seed per round and level); the table keeps each
        server's median per figure, the raw rounds go to ``out["rounds"]``."""
        names = list(servers)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        base = zlib.crc32((level + section).encode()) % 10**6 * 100
        for i in range(rounds or args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order[::-1] if i % 2 else order:  # a round's servers: one seed
                runs[name].append(measure(name, level, servers[name], path, conns, target,
                                          seed=base + i, seconds=seconds))
        for name, rs in runs.items():
            out["rounds"].setdefault(name, {})[level + section] = rs
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("rps", "p50_ms", "p99_ms", "mean_ms")}
            table.setdefault(name, {})[level] = {
                **med, "non_2xx": sum(r["non_2xx"] for r in rs), "target_rps": target}

    def up(specs, with_mode_1: bool = True) -> dict[str, Server]:
        """Start the servers (adaptive ones learn, one at a time, the others idle)."""
        servers = {}
        for name, flags, mode in specs:
            if mode == "1" and not with_mode_1:
                continue
            try:
                servers[name] = start(name, flags, mode)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                failures[name] = str(exc)
                print(f"  {name}: FAILED: {exc}", flush=True)
        time.sleep(5)  # the last learner's shadows drain
        return servers

    def down(servers: dict[str, Server], label: str = "") -> None:
        for name, server in servers.items():
            if name.startswith("mode"):
                try:
                    out["threads"][name + label] = report = server.threads()
                    print(f"{name}{label}: " + threads_summary(report), flush=True)
                except Exception as exc:  # noqa: BLE001 (a report is a bonus)
                    print(f"  {name}: no report: {exc}", flush=True)
            server.close()

    if {"levels", "oracle"} & set(args.only):
        print("== every server up; levels measured in interleaved rounds", flush=True)
        servers = up(SERVERS + ((AGAIN,) if "levels" in args.only else ()),
                     "levels" in args.only)
        try:
            if "levels" in args.only or "oracle" in args.only:
                interleaved(servers, "closed 1", mixed, 1, levels)
            if "levels" in args.only:
                interleaved(servers, "closed 16", mixed, 16, levels)
                capacity = levels.get("fixed 1", {}).get("closed 16", {}).get("rps")
                out["capacity_rps"] = capacity
                for share in POISSON if capacity and math.isfinite(capacity) else ():
                    rate = share * capacity
                    path = script(f"poisson-{share}", think_ms=POISSON_CONNS / rate * 1e3)
                    interleaved(servers, f"poisson {share:.0%}", path, POISSON_CONNS, levels,
                                rate)
            if "oracle" in args.only:
                per = {}
                for c in per_class:
                    interleaved({k: v for k, v in servers.items() if k != AGAIN[0]}, c,
                                per_class[c], 1, per)
                class_ms.update({n: {c: per[n][c]["mean_ms"] for c in per_class}
                                 for n in per})
                mix_ms.update({n: levels[n]["closed 1"]["mean_ms"] for n in servers})
        finally:
            down(servers)

    long_p99 = out["p99"] = {}
    if "p99" in args.only:
        print(f"== p99: fixed 1, {AGAIN[0]} and mode 1 at the Poisson levels, "
              f"{args.p99_rounds} rounds of {args.p99_seconds:g} s", flush=True)
        servers = up((SERVERS[0], AGAIN, SERVERS[2]))
        try:
            if not out["capacity_rps"] and "fixed 1" in servers:
                out["capacity_rps"] = wrk(servers["fixed 1"].url, mixed, 16,
                                          args.seconds)["rps"]
            capacity = out["capacity_rps"]
            for share in POISSON if capacity and math.isfinite(capacity) else ():
                rate = share * capacity
                path = script(f"poisson-{share}", think_ms=POISSON_CONNS / rate * 1e3)
                interleaved(servers, f"poisson {share:.0%}", path, POISSON_CONNS, long_p99,
                            rate, section=P99, rounds=args.p99_rounds,
                            seconds=args.p99_seconds)
        finally:
            down(servers, P99)

    oracle = None
    if {"fixed 1", "fixed 2"} <= set(class_ms):
        # like against like: every server's class means weighted by the mix's shares
        weighted = {s: sum(share * ms[c] for c, share, _ in MIX) for s, ms in class_ms.items()}
        oracle = sum(share * min(class_ms[s][c] for s in ("fixed 1", "fixed 2"))
                     for c, share, _ in MIX)
        out["oracle"] = {"class_mean_ms": class_ms, "oracle_mix_mean_ms": oracle,
                         "weighted_mean_ms": weighted, "mix_mean_ms_at_1": mix_ms,
                         "oracle_over_server": {s: ratio(oracle, m)
                                                for s, m in weighted.items()}}

    if "neighbour" in args.only:
        vouch()  # before the neighbour starts: the sweep checks bits, not time
        print("== neighbour: sha256sum /dev/zero, stopped/continued every 2 s", flush=True)
        with neighbour():
            servers = up(SERVERS, with_mode_1=False)  # mode 2 learns beside the neighbour
            try:
                for c in (16, 1):
                    interleaved(servers, f"closed {c}", mixed, c, nb, section=" + neighbour")
            finally:
                down(servers, " + neighbour")

    if "phases" in args.only:
        print("== neighbour phases: fixed counts with the neighbour off, and on throughout",
              flush=True)
        servers = up(SERVERS[:2])
        try:
            for state in ("off", "on"):
                with neighbour(None) if state == "on" else contextlib.nullcontext():
                    for c in (16, 1):
                        interleaved(servers, f"closed {c}", mixed, c,
                                    phases.setdefault(state, {}), section=f" + {state}")
        finally:
            down(servers)

    # ---- tables
    print()
    if levels:
        print(f"### Load levels (capacity {out['capacity_rps'] or float('nan'):.1f} req/s = fixed 1"
              f" thread, 16 connections; Poisson approximate: {POISSON_CONNS} connections with "
              "exponential think times)\n")
        print(md(["server", "level", "target req/s", "req/s", "p50 ms", "p99 ms", "mean ms",
                  "non-2xx"],
                 [[s, lvl, r.get("target_rps"), r["rps"], r["p50_ms"], r["p99_ms"], r["mean_ms"],
                   r["non_2xx"]] for s, rows in levels.items() for lvl, r in rows.items()]))
        print()
    if long_p99:
        print(f"### p99 section: the Poisson levels again, {args.p99_rounds} rounds of "
              f"{args.p99_seconds:g} s per server and level\n")
        print(md(["server", "level", "target req/s", "req/s", "p50 ms", "p99 ms",
                  "pooled p99 ms", "non-2xx"],
                 [[s, lvl, r.get("target_rps"), r["rps"], r["p50_ms"], r["p99_ms"],
                   pooled_percentile(out["rounds"][s][lvl + P99]), r["non_2xx"]]
                  for s, rows in long_p99.items() for lvl, r in rows.items()]))
        print()
    if oracle is not None:
        print("### Per-length-class oracle at 1 connection (mean ms; per class, not per "
              "padded-token range)\n")
        names = list(class_ms)
        print(md(["class", "share", *names, "oracle (best fixed)"],
                 [[c, share, *(class_ms[n][c] for n in names),
                   min(class_ms["fixed 1"][c], class_ms["fixed 2"][c])] for c, share, _ in MIX]
                 + [["weighted by share", None,
                     *(out["oracle"]["weighted_mean_ms"][n] for n in names), oracle]]))
        print()
        print(md(["server", "class-weighted mean ms", "oracle / server", "mix mean ms at 1"],
                 [[s, m, out["oracle"]["oracle_over_server"][s], mix_ms.get(s)]
                  for s, m in out["oracle"]["weighted_mean_ms"].items()]))
        print()
    if nb:
        print("### Neighbour on half the time (one core's worth of sha256sum, 2 s on / 2 s off)\n")
        print(md(["server", "16 conn req/s", "p50 ms", "p99 ms", "1 conn req/s", "p50 ms",
                  "p99 ms"],
                 [[s] + [r[f"closed {c}"][k] for c in (16, 1) for k in ("rps", "p50_ms", "p99_ms")]
                  for s, r in nb.items()]))
        print()

    def rps(table: dict, server: str, level: str) -> float | None:
        return table.get(server, {}).get(level, {}).get("rps")

    if phases:
        print("### Neighbour phases: what following it could gain (req/s; the per-phase oracle "
              "is the better fixed count in each phase, half the time each)\n")
        rows = []
        for c in (16, 1):
            lvl = f"closed {c}"
            best = {st: max(phases[st][s][lvl]["rps"] for s in phases[st]) for st in phases}
            oracle_rps = sum(best.values()) / len(best)
            toggled = rps(nb, "fixed 2", lvl)
            out["phase_oracle"][lvl] = {"rps": oracle_rps, "over_fixed_2_toggling":
                                        ratio(oracle_rps, toggled)}
            rows.append([lvl, *(phases[st][s][lvl]["rps"] for st in ("off", "on")
                                for s in ("fixed 1", "fixed 2")),
                         oracle_rps, toggled, ratio(oracle_rps, toggled),
                         ratio(rps(nb, "mode 2", lvl), oracle_rps)])
        print(md(["level", "off: fixed 1", "off: fixed 2", "on: fixed 1", "on: fixed 2",
                  "per-phase oracle", "fixed 2, toggling", "oracle / fixed 2 toggling",
                  "mode 2 toggling / oracle"], rows))
        print()

    def best_fixed(table: dict, level: str) -> float | None:
        vals = [v for s in ("fixed 1", "fixed 2") if (v := rps(table, s, level)) is not None]
        return max(vals) if len(vals) == 2 else None

    def best_fixed_name(table: dict, level: str) -> str | None:
        if best_fixed(table, level) is None:
            return None
        return max(("fixed 1", "fixed 2"), key=lambda s: rps(table, s, level))

    def paired(a: str, b: str | None, key: str, level: str) -> list[float]:
        """Round by round, ``a``'s figure over ``b``'s in the same round: the two ran within
        a minute of each other, so a drift of the host between rounds cancels."""
        ra = out["rounds"].get(a, {}).get(level, [])
        rb = out["rounds"].get(b, {}).get(level, [])
        return [v for x, y in zip(ra, rb, strict=False)
                if (v := ratio(x[key], y[key])) is not None]

    def oracle_rounds() -> list[float]:
        """Per round: the oracle (the better fixed count per class, that round) over mode 2's
        class means weighted by the mix."""
        per = {s: [out["rounds"].get(s, {}).get(c, []) for c, _, _ in MIX]
               for s in ("fixed 1", "fixed 2", "mode 2")}
        rounds = min((len(rs) for runs in per.values() for rs in runs), default=0)
        vals = []
        for i in range(rounds):
            best = sum(share * min(per[s][k][i]["mean_ms"] for s in ("fixed 1", "fixed 2"))
                       for k, (_, share, _) in enumerate(MIX))
            mine = sum(share * per["mode 2"][k][i]["mean_ms"]
                       for k, (_, share, _) in enumerate(MIX))
            if (v := ratio(best, mine)) is not None:
                vals.append(v)
        return vals

    def pooled_p99(server: str, level: str) -> float | None:
        return pooled_percentile(out["rounds"].get(server, {}).get(level, []))

    targets = [("(a) mode 2 req/s at 16 clients / best fixed count", ">= 0.97",
                ratio(rps(levels, "mode 2", "closed 16"), best_fixed(levels, "closed 16")),
                paired("mode 2", best_fixed_name(levels, "closed 16"), "rps", "closed 16"),
                lambda v: v >= 0.97, None),
               ("(b) per-class oracle mean / mode 2 mean at 1 client", ">= 0.97",
                (out["oracle"].get("oracle_over_server") or {}).get("mode 2"),
                oracle_rounds() if oracle is not None else [], lambda v: v >= 0.97, None)]
    def p99_target(name: str, lvl: str, table: dict, section: str = "") -> tuple:
        """``name``'s p99 over fixed 1's: mode 1's is target (c); the second fixed 1's is
        the null check, the noise of this run's p99 ratios."""
        null = name == AGAIN[0]
        return (f"{'(n) null check:' if null else '(c)'} {name} p99 / fixed 1 p99, "
                f"{lvl}{section}", "<= 1.05" + (" (noise)" if null else ""),
                ratio(table.get(name, {}).get(lvl, {}).get("p99_ms"),
                      table.get("fixed 1", {}).get(lvl, {}).get("p99_ms")),
                paired(name, "fixed 1", "p99_ms", lvl + section), lambda v: v <= 1.05,
                ratio(pooled_p99(name, lvl + section), pooled_p99("fixed 1", lvl + section)))

    for lvl in ("closed 1", "closed 16", *(f"poisson {s:.0%}" for s in POISSON)):
        targets += [p99_target(n, lvl, levels) for n in ("mode 1", AGAIN[0])
                    if n == "mode 1" or n in levels]
    for lvl in long_p99.get("fixed 1", {}):
        targets += [p99_target(n, lvl, long_p99, P99) for n in ("mode 1", AGAIN[0])
                    if n in long_p99]
    for c in (16, 1):
        lvl = f"closed {c}"
        targets.append((f"(d) neighbour: mode 2 req/s / best fixed count, {c} client(s)", "> 1.00",
                        ratio(rps(nb, "mode 2", lvl), best_fixed(nb, lvl)),
                        paired("mode 2", best_fixed_name(nb, lvl), "rps", lvl + " + neighbour"),
                        lambda v: v > 1.0, None))
    out["targets"] = [
        {"target": t, "goal": g, "value": v, "met": None if v is None else ok(v),
         "paired_rounds": each, "paired_median": statistics.median(each) if each else None,
         "rounds_met": sum(map(ok, each)), "pooled": pooled,
         "pooled_met": None if pooled is None else ok(pooled)}
        for t, g, v, each, ok, pooled in targets]
    print("### Targets (this run only)\n")
    print("measured: each server's median over the rounds, then the ratio; paired: the ratio "
          "round by round against the same round's figure (median, and the rounds that met "
          "the goal); pooled (p99 targets): each server's p99 over the requests of all its "
          "rounds together, then the ratio\n")

    def fmt(v: float | None) -> str | None:
        return None if v is None else f"{v:.3f}"

    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else "met" if met else "MISSED"

    print(md(["target", "measured", "paired median", "rounds met", "pooled", "goal",
              "result (measured; pooled)"],
             [[t["target"], fmt(t["value"]), fmt(t["paired_median"]),
               f"{t['rounds_met']} of {len(t['paired_rounds'])}", fmt(t["pooled"]), t["goal"],
               verdict(t["met"]) + ("" if t["pooled"] is None
                                    else f"; {verdict(t['pooled_met'])}")]
              for t in out["targets"]]))

    for label, why in failures.items():
        print(f"FAILED: {label}: {why}")
    out["meta"]["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(compact(json.dumps(clean(out), indent=1)) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
