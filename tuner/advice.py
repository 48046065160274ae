"""What a learned-thread report says (R4.10): the learning state of one worker (or one scope of
the host record) and one recommendation for its operator, as pure functions of the report's
plain data (``report.build``), so the server, the offline record and the metrics agree."""

from __future__ import annotations

import enum

from vllm_srun.tuner.policy import RangeState


class LearningState(enum.StrEnum):
    LOCKED = "locked"  # adaptive threads off, or the golden check has not passed
    LEARNING = "learning"  # timing counts; every answer at the configured count
    SERVING = "serving"  # mode 2: at least one range serves a learned count
    RETIRED = "retired"  # a drift retired learning: configured count until a reset


OFF_REASON = "adaptive threads are off (VLLM_SRUN_CPU_ADAPTIVE_THREADS unset or 0)"


def learning_state(report: dict) -> tuple[LearningState, str]:
    """The state and, in words, why."""
    ranges = report["ranges"]
    if report.get("drift"):
        d = report["drift"]
        return LearningState.RETIRED, (
            f"answers drifted across thread counts (seen by {d.get('worker') or 'a worker'}"
            f"{' at ' + d['seen_at'] if d.get('seen_at') else ''}): every range serves the "
            "configured count until `vllm-srun threads reset`")
    if report["mode"] == 0:
        return LearningState.LOCKED, report.get("locked_reason") or OFF_REASON
    if report.get("locked_reason"):
        return LearningState.LOCKED, report["locked_reason"]
    serving = [r for r in ranges if r["state"] == RangeState.SERVING]
    learned = [r for r in ranges if r["learned_threads"] is not None]
    if serving:
        return LearningState.SERVING, (f"{len(serving)} of {len(ranges)} ranges serve a "
                                       "learned count")
    what = "mode 1 learns and reports" if report["mode"] == 1 else "mode 2"
    return LearningState.LEARNING, (f"{what}: {len(learned)} of {len(ranges)} ranges "
                                    "learned, every answer at the configured count")


def recommendation(report: dict, state: LearningState) -> str:
    """One sentence: what to set (or keep) for the traffic the report saw."""
    configured = report["configured_threads"]
    if state is LearningState.RETIRED:
        return (f"keep --threads {configured}: answers are not bit-identical across counts "
                "on this host; fix the cause (see notes), then `vllm-srun threads reset`")
    if state is LearningState.LOCKED:
        if report["mode"] == 0 and report.get("locked_reason", OFF_REASON) != OFF_REASON:
            return f"nothing to set here: {report['locked_reason']}"
        if report["mode"] == 0:
            return ("set VLLM_SRUN_CPU_ADAPTIVE_THREADS=1 to learn the fastest count per input "
                    f"size (answers stay at --threads {configured})")
        return (f"keep --threads {configured}: learning is locked ({report['locked_reason']})")
    ranges = report["ranges"]
    learned = [r for r in ranges if r["learned_threads"] is not None]
    if not ranges:
        return "send traffic: no forward has been timed yet"
    if not learned:
        return (f"keep learning: none of {len(ranges)} ranges has learned a count yet (each "
                f"count needs {report.get('decision_min_samples', '?')} samples, more where "
                f"two are close)")
    if state is LearningState.SERVING:
        ups = [r["speedup"] for r in learned if r["speedup"] and r["state"] ==
               RangeState.SERVING]
        return (f"keep mode 2 on: it serves learned counts in {len(ups)} of {len(ranges)} "
                f"ranges (up to {max(ups, default=1.0):.2f}x the configured count's speed)")
    best = {r["learned_threads"] for r in learned}
    if best == {configured}:
        margin = report.get("decision_margin")
        beat = f" by {margin:.0%}" if margin is not None else ""
        return (f"keep --threads {configured}: no other count beat it{beat} in the "
                f"{len(learned)} learned ranges")
    vouched = report["voucher"]["vouches"]
    mode2 = ("mode 2 (VLLM_SRUN_CPU_ADAPTIVE_THREADS=2" +
             (")" if vouched else ", after `vllm-srun threads verify`)"))
    if len(best) == 1:
        (count,) = best
        ups = ", ".join(f"{r['size_range']} {r['speedup']:.2f}x" for r in learned
                        if r["speedup"])
        rest = len(ranges) - len(learned)
        return (f"set --threads {count} for this traffic: every learned range runs fastest "
                f"at {count} ({ups}{f'; {rest} more still learning' if rest else ''}); "
                f"or {mode2} serves it per range")
    if report["mode"] == 2 and vouched:
        return "keep mode 2 on: learned counts serve once their transition window passes"
    per = ", ".join(f"{r['size_range']}: {r['learned_threads']}" for r in learned)
    return f"use {mode2}: the fastest count differs by range ({per})"
