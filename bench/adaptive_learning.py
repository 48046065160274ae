"""Learning under the measured load itself: the two sections of ``bench.adaptive_load`` where a
mode-2 server starts from a fresh record and learns from its first second, with no bursty
learning phase before it is measured (the old bench learned only from bursts with pauses,
so it never saw a server that learns a count under steady load but never serves it).

- ``steady``: every server at ``conns`` closed-loop connections (wrk) for ``seconds``, measured
  in consecutive windows of ``window_s``; a fresh mode 2 per round, against fixed 1, fixed 2 and
  the null check (a second fixed 1), in rotating order per round.
- ``regret``: one open-loop trace per round (the same bodies file, seed and schedule for every
  server), and each server's served forward time per padded-token range over it (``/metrics``):
  a fresh mode 2's total, learning included, against the per-range oracle built from the fixed
  servers' per-range times over the same trace (``bench.load_trace.range_oracle``).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable
from pathlib import Path

from bench import openloop
from bench.adaptive_wrk import Server, range_counts, range_states, wrk
from bench.load_trace import forward_totals, range_oracle, since, total_seconds

MODE2 = "mode 2 (fresh, no learning phase)"


def rotated(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order: rotated by ``i``, backwards every other round."""
    order = names[i % len(names):] + names[:i % len(names)]
    return order[::-1] if i % 2 else order


def _each(fixed: dict[str, Server], fresh: Callable[[], Server], i: int, log,
          run: Callable[[str, Server], dict]) -> dict[str, dict]:
    """Round ``i``: every fixed server and one fresh mode 2 (closed after its run, with what
    it learned, ``GET /v1/threads``, kept as ``threads``)."""
    out = {}
    for name in rotated([*fixed, MODE2], i):
        if name != MODE2:
            out[name] = run(name, fixed[name])
            continue
        server = fresh()
        try:
            out[name] = run(name, server)
            try:
                report = server.threads()
                out[name]["ranges_after"] = range_states(report)
            except Exception as exc:  # noqa: BLE001 (a report is a bonus)
                log(f"  {name}: no threads report: {exc}")
        finally:
            server.close()
    return out


# The settling windows (mode 2 alone, nothing paired with them) are about 10 s: a line of
# 12 per round is readable. The measured windows are short and paired: ``--window-seconds``.
SETTLE_WINDOW_S = 10.0


def steady(fixed: Callable[[], dict[str, Server]], fresh: Callable[[], Server], script: str,
           conns: int, seconds: float, window_s: float, rounds: int, log=print,
           settle_s: float = 0.0) -> list[dict[str, dict]]:
    """Per round, per server: its windows (req/s, p50, p99 of each). Every round starts its
    own servers, the ``fixed`` ones and a ``fresh`` mode 2, and closes them after. The mode 2
    first serves ``settle_s`` of the load alone (``settle_windows`` of ``SETTLE_WINDOW_S``,
    other bodies); then every server runs ``seconds`` in windows of ``window_s`` taken in
    turn, window k of each server one after another (the order rotated per window, the same
    bodies for all in window k), so a slow stretch of the shared host falls on all of them
    alike. Run one after another, whole minutes apart, two identical servers differed by
    0.86-1.14x (95% interval, 6 rounds); the windows must be shorter than the host's slow
    stretches (``--window-seconds``). Fixed servers started once for all rounds kept an
    offset of their own: two identical fixed 2 servers differed by 0.948 [0.934, 0.959] in
    every window position of 6 rounds, which pairing within a round cannot remove; started
    per round, like the mode 2, an instance's offset is one draw of each round's ratio."""
    windows = max(1, round(seconds / window_s))
    settle = math.ceil(settle_s / SETTLE_WINDOW_S)
    settle_window_s = settle_s / settle if settle else 0.0
    base = zlib.crc32(b"steady") % 10**6 * 100

    def window(server: Server, seed: int, seconds: float = window_s) -> dict:
        r = wrk(server.url, script, conns, seconds, seed=seed)
        return {"seconds": seconds, **{key: r[key] for key in (
            "rps", "p50_ms", "p99_ms", "requests", "non_2xx", "errors")}}

    def show(name: str, ws: list[dict]) -> None:
        log(f"  steady {name:34} " + " ".join(f"{w['rps']:5.1f}" for w in ws) + " req/s")

    out = []
    for i in range(rounds):
        base += 10_000  # a server's rounds never repeat a body (its result cache)
        fixed_now: dict[str, Server] = {}
        server = None
        try:
            fixed_now = fixed()
            server = fresh()
            early = [window(server, base + 5_000 + k, settle_window_s) for k in range(settle)]
            settled, settled_counts = {}, {}
            if early:
                show(MODE2 + " (settling)", early)
                # what it serves once settled: between its windows below it idles while
                # the others run, and idle time lets shadows finish what load left undone
                with contextlib.suppress(Exception):
                    report = server.threads()
                    settled, settled_counts = range_states(report), range_counts(report)
            servers = {**fixed_now, MODE2: server}
            got: dict[str, list[dict]] = {n: [] for n in servers}
            for k in range(windows):
                for name in rotated(list(servers), i + k):
                    got[name].append(window(servers[name], base + k))
            rnd = {n: {"windows": ws, "settle_windows": early if n == MODE2 else [],
                       "url": servers[n].url} for n, ws in got.items()}
            for n, ws in got.items():
                show(n, ws)
            rnd[MODE2]["ranges_settled"] = settled
            rnd[MODE2]["counts_settled"] = settled_counts
            try:
                report = server.threads()
                rnd[MODE2]["ranges_after"] = range_states(report)
                rnd[MODE2]["counts_after"] = range_counts(report)
                # what learning did: fallbacks under contention, samples, paid shadows
                rnd[MODE2]["learning_after"] = report.get("learning", {})
            except Exception as exc:  # noqa: BLE001 (a report is a bonus)
                log(f"  {MODE2}: no threads report: {exc}")
        finally:
            for s in (*fixed_now.values(), *((server,) if server else ())):
                s.close()
        out.append(rnd)
    return out


def regret(fixed: dict[str, Server], fresh: Callable[[], Server],
           bodies: Callable[[int], Path], rate_rps: float, seconds: float, rounds: int,
           connections: int = 64, log=print) -> list[dict[str, dict]]:
    """Per round, per server: the trace's open-loop summary and the served forward time per
    padded-token range (``ranges``: {range: [forwards, seconds]}) it ran."""
    out = []
    for i in range(rounds):
        path, seed = bodies(i), zlib.crc32(b"regret") % 10**6 + i

        def run(name: str, server: Server, path=path, seed=seed) -> dict:
            before = forward_totals(server.url)
            r = openloop.run(server.url, path, rate_rps, seconds, seed, connections)
            ranges = since(forward_totals(server.url), before)
            log(f"  regret {name:34} {r['achieved_rps']:6.1f} req/s  p50 {r['p50_ms']:7.1f}"
                f"  p99 {r['p99_ms']:7.1f} ms  served {total_seconds(ranges):6.2f} s")
            return {**r, "ranges": {k: [t.forwards, t.seconds] for k, t in ranges.items()}}

        out.append(_each(fixed, fresh, i, log, run))
    return out


def windows_rps(run: dict, part: str = "all") -> float:
    """Req/s over a steady run's measured windows: all of them, the second half (``late``),
    or with the settling windows before them (``learning``: a fresh mode 2 from its first
    second; a fixed server has none), each window weighted by its length (the settling
    windows are longer than the measured ones; results without lengths: equal)."""
    ws = run["windows"]
    ws = ws[len(ws) // 2:] if part == "late" else ws
    if part == "learning":
        ws = [*run.get("settle_windows", ()), *ws]
    return sum(w["rps"] * w.get("seconds", 1.0) for w in ws) / sum(
        w.get("seconds", 1.0) for w in ws)


def regret_figures(rnd: dict[str, dict], fixed_names: tuple[str, ...]) -> dict:
    """One round of the regret section: each server's served seconds and the oracle's."""
    from bench.load_trace import RangeTime

    def ranges(name: str) -> dict:
        return {k: RangeTime(*v) for k, v in rnd[name]["ranges"].items()}

    oracle = range_oracle(ranges(MODE2), {n: ranges(n) for n in fixed_names if n in rnd})
    return {"served_s": {n: total_seconds(ranges(n)) for n in rnd}, **oracle}
