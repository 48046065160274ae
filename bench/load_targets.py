"""The targets of ``bench.adaptive_load``, judged on intervals (SPEC R8.2): each ratio with its
bootstrap 95% interval over paired rounds, its verdict (met only when the whole interval
clears the goal) and, beside it, the null check's interval for the same figure at the same
level (``fixed 1 again`` over ``fixed 1``: two identical servers, so the noise of that ratio;
for ``steady``, the best fixed count's twin where the run has one, ``fixed 2 again``).

Everything here reads the run's results (``out``: the rounds of every server and level, the
raw open-loop latencies kept in memory) and returns rows; nothing runs a server.
"""

from __future__ import annotations

import math
import statistics

from bench.adaptive_learning import MODE2, regret_figures, windows_rps
from bench.adaptive_wrk import MIX
from bench.stats import (
    NONE,
    Goal,
    Interval,
    median_interval,
    paired_ratios,
    percentile,
    pooled_ratio_interval,
    sum_ratio_interval,
    verdict,
)

AGAIN = "fixed 1 again"
AGAIN_2 = "fixed 2 again"
FIXED = ("fixed 1", "fixed 2")


def _rounds(out: dict, name: str, level: str) -> list[dict]:
    return out["rounds"].get(name, {}).get(level, [])


def paired(out: dict, a: str, b: str | None, key: str, level: str) -> list[float]:
    """Round by round, ``a``'s figure over ``b``'s in the same round."""
    return paired_ratios([r[key] for r in _rounds(out, a, level)],
                         [r[key] for r in _rounds(out, b, level)] if b else [])


def best_fixed(out: dict, level: str) -> str | None:
    """The fixed count with the higher median req/s at ``level`` over the rounds."""
    med = {s: statistics.median(r["rps"] for r in rs) for s in FIXED
           if (rs := _rounds(out, s, level))}
    return max(med, key=med.__getitem__) if len(med) == 2 else None


def row(target: str, goal: str, interval: Interval, null: Interval) -> dict:
    g = Goal.parse(goal)
    return {"target": target, "goal": goal, "estimate": interval.estimate, "lo": interval.lo,
            "hi": interval.hi, "rounds": interval.rounds, "verdict": verdict(interval, g),
            "null": {"estimate": null.estimate, "lo": null.lo, "hi": null.hi,
                     "rounds": null.rounds}, "text": interval.text(), "null_text": null.text()}


def concurrent_targets(out: dict) -> list[dict]:
    """Mode 2 with two forwards at once over the better fixed configuration at each level
    (fixed 2 threads, or 1 thread with two forwards at once), beside that one's twin."""
    rows = []
    for c in (1, 16):
        level = f"closed {c} x2"
        med = {s: statistics.median(r["rps"] for r in rs) for s in ("fixed 2", "fixed 1 x2")
               if (rs := _rounds(out, s, level))}
        if len(med) < 2 or not _rounds(out, "mode 2 x2", level):
            continue
        best = max(med, key=med.__getitem__)
        rows.append(row(f"(x) mode 2 x2 req/s / best fixed ({best}), {level}; null check "
                        f"{best} again / {best}", ">= 0.97",
                        median_interval(paired(out, "mode 2 x2", best, "rps", level)),
                        median_interval(paired(out, f"{best} again", best, "rps", level))))
    return rows


def rps_target(out: dict, label: str, level: str, goal: str) -> dict:
    """Mode 2's req/s over the best fixed count's, beside the null check of that count's twin
    where the run has one (else fixed 1 again / fixed 1)."""
    best = best_fixed(out, level)
    twin = (f"{best} again", best) if best and _rounds(out, f"{best} again", level) else (
        AGAIN, "fixed 1")
    return row(f"{label} {MODE2 if 'steady' in level else 'mode 2'} req/s / best fixed "
               f"({best}), {level}; null check {twin[0]} / {twin[1]}", goal,
               median_interval(paired(out, "mode 2", best, "rps", level)) if best else NONE,
               median_interval(paired(out, *twin, "rps", level)))


def p99_target(out: dict, raw: dict, level: str) -> dict:
    """Mode 1's p99 over fixed 1's: pooled over every request of the rounds where the raw
    open-loop latencies are known (a drawn round takes both servers' requests), else the
    median of the per-round ratios."""
    def interval(a: str) -> Interval:
        ra, rb = raw.get(a, {}).get(level), raw.get("fixed 1", {}).get(level)
        if ra and rb:
            return pooled_ratio_interval(ra, rb, lambda v: percentile(v, 99))
        return median_interval(paired(out, a, "fixed 1", "p99_ms", level))
    pooled = " (pooled over rounds)" if raw.get("fixed 1", {}).get(level) else ""
    return row(f"(c) mode 1 p99 / fixed 1 p99{pooled}, {level}", "<= 1.05",
               interval("mode 1"), interval(AGAIN))


def class_oracle_rounds(out: dict, name: str) -> list[float]:
    """Per round: the oracle (the better fixed count per length class that round) over
    ``name``'s class means, weighted by the mix."""
    per = {s: [_rounds(out, s, c) for c, _, _ in MIX] for s in (*FIXED, name)}
    n = min((len(rs) for runs in per.values() for rs in runs), default=0)
    vals = []
    for i in range(n):
        best = sum(share * min(per[s][k][i]["mean_ms"] for s in FIXED)
                   for k, (_, share, _) in enumerate(MIX))
        mine = sum(share * per[name][k][i]["mean_ms"] for k, (_, share, _) in enumerate(MIX))
        vals += paired_ratios([best], [mine])
    return vals


def class_null_rounds(out: dict) -> list[float]:
    """Per round: fixed 1's class-weighted mean over fixed 1 again's."""
    per = {s: [_rounds(out, s, c) for c, _, _ in MIX] for s in ("fixed 1", AGAIN)}
    n = min((len(rs) for runs in per.values() for rs in runs), default=0)
    return [v for i in range(n) for v in paired_ratios(
        [sum(sh * per["fixed 1"][k][i]["mean_ms"] for k, (_, sh, _) in enumerate(MIX))],
        [sum(sh * per[AGAIN][k][i]["mean_ms"] for k, (_, sh, _) in enumerate(MIX))])]


def steady_targets(out: dict) -> list[dict]:
    rounds = out.get("steady_rounds") or []
    rows: list[dict] = []
    if not rounds:
        return rows
    settle = out.get("meta", {}).get("steady_settle_seconds") or 0
    parts = (("all", f"after {settle:.0f} s of that load"),
             ("learning", "learning included (its first second on; fixed servers alike)"),
             ("late", "second half of the windows after it")) if settle else (
        ("all", "whole run, learning included"), ("late", "second half of the windows"))
    for part, label in parts:
        def ratio(a: str, b: str, part=part) -> list[float]:
            return paired_ratios([windows_rps(r[a], part) if a in r else None for r in rounds],
                                 [windows_rps(r[b], part) if b in r else None for r in rounds])
        med = {s: statistics.median(windows_rps(r[s], part) for r in rounds)
               for s in FIXED if all(s in r for r in rounds) and rounds}
        best = max(med, key=med.__getitem__) if len(med) == 2 else None
        # the null check of the count the ratio divides by, where the run has its twin
        twin = next(((a, b) for a, b in ((f"{best} again", best), (AGAIN, "fixed 1"),
                                          (AGAIN_2, "fixed 2"))
                     if best and all(a in r for r in rounds)), None)
        null = median_interval(ratio(*twin)) if twin else NONE
        rows.append(row(f"(s) steady: {MODE2} req/s / best fixed ({best}), {label}"
                        + (f"; null check {twin[0]} / {twin[1]}" if twin else ""),
                        ">= 0.97", median_interval(ratio(MODE2, best)) if best else NONE, null))
        if twin and part == "all":
            # the best count also taken over both its instances: where the fixed servers ran
            # every round as the same instances, two identical ones differed by 0.948 [0.934,
            # 0.959] in every window position (bfloat16, 6 rounds), an offset pairing cannot
            # remove; started per round (``adaptive_learning.steady``) each offset is one draw
            # of a round's ratio, and this row reads beside the one over a single instance
            both = paired_ratios(
                [windows_rps(r[MODE2], part) if MODE2 in r else None for r in rounds],
                [math.sqrt(windows_rps(r[best], part) * windows_rps(r[twin[0]], part))
                 for r in rounds])
            rows.append(row(f"(s) steady: {MODE2} req/s / best fixed over both its instances "
                            f"({best}, {twin[0]}; geometric mean), {label}; null check "
                            f"{twin[0]} / {twin[1]}", ">= 0.97", median_interval(both), null))
    return rows


def regret_target(out: dict) -> list[dict]:
    rounds = out.get("regret_rounds") or []
    figs = [regret_figures(r, FIXED) for r in rounds if MODE2 in r]
    if not figs:
        return []
    served = [f["served_s"] for f in figs]
    return [row("(e) regret: mode 2 served forward s (fresh, learning included) / per-range "
                "oracle s (provisional goal)", "<= 1.05",
                sum_ratio_interval([s[MODE2] for s in served], [f["oracle_s"] for f in figs]),
                sum_ratio_interval([s.get(AGAIN, float("nan")) for s in served],
                                   [s.get("fixed 1", float("nan")) for s in served]))]


def targets(out: dict, raw: dict) -> list[dict]:
    """Every target this run has the figures for, in order (a) ... (e)."""
    rows = []
    if _rounds(out, "mode 2", "closed 16"):
        rows.append(rps_target(out, "(a)", "closed 16", ">= 0.97"))
    # where the best count moves with input size (a precision or host where 1 thread wins
    # short inputs and 2 long ones), mode 2 must beat every fixed count, not only keep up
    for c in (1, 16):
        if _rounds(out, "mode 2", f"closed {c}"):
            rows.append(rps_target(out, "(m) where the best count moves:", f"closed {c}",
                                   "> 1.00"))
    if class_oracle_rounds(out, "mode 2"):
        rows.append(row("(b) per-class oracle mean / mode 2 mean at 1 client", ">= 0.97",
                        median_interval(class_oracle_rounds(out, "mode 2")),
                        median_interval(class_null_rounds(out))))
    for level in out.get("levels_order", []):
        if _rounds(out, "mode 1", level):
            rows.append(p99_target(out, raw, level))
    for c in (16, 1):
        if _rounds(out, "mode 2", f"closed {c} + neighbour"):
            rows.append(rps_target(out, "(d) neighbour", f"closed {c} + neighbour", "> 1.00"))
    return rows + steady_targets(out) + regret_target(out) + concurrent_targets(out)


def table(rows: list[dict]) -> list[list]:
    return [[r["target"], r["text"], r["goal"], r["verdict"], r["null_text"],
             f"{r['rounds']}"] for r in rows]
