"""The learned-thread report (R4.10): one plain-data shape for ``GET /v1/threads`` and
``vllm-srun threads report`` (``document``: the same JSON from the live server and from the
offline record); ``report_view.py`` shows it as text tables and a plot.

A document is ``{"object": "threads.report", "source": "server" | "record", "reports": [...]}``
with one report per worker (live: per replica, named by ``deployment`` and ``replica``) or per
scope of the record. Each report has the same keys (``build``, ``off_report``): its learning
``state`` with ``state_reason`` and a ``recommendation`` (``advice.py``), and per range the
statistic the decision uses (``decision_statistic``: the median, ``estimator.estimate``) per
count with its ~80% interval (``interval_ms``) and the p90, and the paid learning share."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from vllm_srun.records.host_record import DriftEvent, Scope, Voucher
from vllm_srun.tuner.adaptive import AdaptiveThreads
from vllm_srun.tuner.advice import OFF_REASON, learning_state, recommendation
from vllm_srun.tuner.estimator import estimate, past_a_slower_count, speedup
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import summarize
from vllm_srun.tuner.ranges import RangeLearning, RangeState, report_state, sized, wanted_count

CBWR_REMEDY = ("answers drifted across thread counts with the torch backend; start the worker "
               "with --mkl-cbwr (sets MKL_CBWR=AUTO before torch loads), which made this kind "
               "of host bit-identical across counts, then `vllm-srun threads reset`")
# the statistic ``estimator.choose`` compares counts by, as named in reports
DECISION_STATISTIC = "median_ms"
# ... of each sample as a forward of its range's smallest size, by the range's fitted size
# exponent (``ranges.sized``): what the learner compares; the report shows the counts'
# medians in ms beside it
DECISION_PER = "range_smallest_size"


@dataclass(frozen=True)
class RecordState:
    """What the host record and the exactness ledger say for the scope."""

    scope: Scope
    voucher: Voucher
    drift: DriftEvent | None = None  # the drift that retired learning, if any
    locked_reason: str | None = None
    path: str | None = None
    error: str | None = None  # why it was not written (learning kept in memory)


@dataclass(frozen=True)
class DecisionRule:
    """``TunerSettings.margin`` and ``min_samples``, as the decision used them."""

    margin: float | None = None
    min_samples: int | None = None


@dataclass(frozen=True)
class ReportInput:
    mode: AdaptiveMode
    configured: int
    counts: tuple[int, ...]
    ranges: dict[int, RangeLearning]
    record: RecordState
    decision: DecisionRule = DecisionRule()
    model: str | None = None
    verified_passes: dict[int, int] = field(default_factory=dict)  # the ledger's, per range
    uncovered: int = 0  # forwards kept at the configured count: shape not vouched for
    learning: dict[str, object] = field(default_factory=dict)  # what timed and checked what
    shadow_error: str | None = None
    # range -> count -> why it is no longer timed (``Learner.unreachable``)
    unreachable: dict[int, dict[int, str]] = field(default_factory=dict)


def from_tuner(t: AdaptiveThreads, record_path: str | None = None) -> ReportInput:
    """A copy of the tuner's state (the engine and shadow threads keep changing it)."""
    with t.lock:
        ranges = {lo: replace(r, samples={n: list(v) for n, v in r.samples.items()},
                              tokens={n: list(v) for n, v in r.tokens.items()})
                  for lo, r in t.learner.ranges.items()}
        passes = {lo: t.ledger.progress(lo, r.learned) for lo, r in ranges.items()
                  if r.learned is not None}
        unreachable = {lo: t.learner.unreachable(r) for lo, r in t.learner.ranges.items()}
        window = t.free_cores.window
        paid = t.side.paid
        served_s = paid.served_s
    record = RecordState(t.sync.scope, t.ledger.voucher, t.ledger.retired,
                         t.ledger.locked_reason, record_path, t.sync.error)
    return ReportInput(t.mode, t.configured, t.counts, ranges, record,
                       DecisionRule(t.settings.learning.margin, t.settings.learning.min_samples),
                       verified_passes=passes, uncovered=t.tally.uncovered,
                       unreachable=unreachable,
                       shadow_error=t.side.error, learning={
                           "forwards_served": t.tally.forwards,
                           "shadow_comparisons": t.ledger.comparisons, "audits": t.ledger.audits,
                           "shadows_overlapped_not_timed": t.tally.discarded,
                           "shadows_preempted_not_timed": t.tally.preempted,
                           "shadow_batches_replaced_unrun": t.learner.board.replaced,
                           "served_forwards_that_froze_a_shadow": t.tally.frozen_beside,
                           "served_forwards_timed": t.tally.served_samples,
                           # ... of them divided by a load factor over 1: other tasks held
                           # cores they needed (``samples.load_factor``)
                           "served_forwards_timed_scaled_for_held_cores": t.tally.samples_scaled,
                           "served_forwards_not_timed_cores_held": t.tally.samples_cores_held,
                           "forwards_served_to_time_a_count": t.tally.explored,
                           "forwards_served_below_learned_under_contention": t.tally.contended,
                           # several forwards at once: served below the count wanted, the
                           # others held the cores; and forwards another ran beside (no
                           # samples)
                           "forwards_served_lower_beside_other_forwards": t.tally.beside,
                           "served_forwards_not_timed_beside_another": t.tally.not_solo,
                           # mode 2: not explored on, more rows waited than one forward
                           # takes (``Engine.behind``)
                           "forwards_not_explored_engine_behind": t.tally.behind,
                           # the cores other tasks left this worker over the last window
                           # read (None: not read)
                           "free_cores_now": round(window[0], 2) if window else None,
                           # shadow time against its budget (``budget_fraction`` of the
                           # time since learning began, idle time banked for
                           # ``budget_window_s`` at most): over it, no shadow starts
                           "shadow_seconds": round(t.side.budget.used_s, 3),
                           # failed shadow forwards (the shadow process died or hung, and
                           # was started again), each retried after a backoff
                           "shadow_faults": t.side.faults,
                           "shapes_verified_in_idle_time": t.side.verifier.verified,
                           # ... and, where no idle time came, paid from the learning share
                           "shapes_verified_paid": t.side.verifier.verified_paid,
                           # ... of both, against the answer served for a batch of the shape
                           # (no forward at the configured count run for it)
                           "shapes_verified_against_served_answers":
                               t.side.verifier.against_served,
                           "shadow_wall_seconds": round(t.side.wall_s, 3),
                           "shadow_budget_seconds": round(t.shadow_budget_s(), 3),
                           # R4.5 amended: shadows run at normal priority beside served
                           # forwards where no idle CPU came, paid from ``learning_share``
                           # of served forward time
                           "learning_share": paid.share,
                           "paid_shadows": paid.paid_shadows,
                           "paid_shadow_seconds": round(paid.paid_s, 3),
                           "served_forward_seconds": round(served_s, 3),
                           "paid_share_of_served": round(paid.paid_s / served_s, 4)
                           if served_s else 0.0,
                           # ... those that timed a count ran in the served forwards' place:
                           # the served forwards that waited for one, and how long in all
                           "served_forwards_that_waited_for_a_paid_shadow": t.tally.waited,
                           "served_wait_seconds_for_paid_shadows": round(t.tally.waited_s,
                                                                          3)})


def range_state(inp: ReportInput, r: RangeLearning) -> RangeState:
    rec = inp.record
    no_voucher = inp.mode is AdaptiveMode.SERVE and r.learned is not None and \
        not rec.voucher.covers_counts(r.learned, inp.configured)
    return report_state(r, rec.locked_reason is not None, rec.drift is not None, no_voucher)


def build(inp: ReportInput) -> dict:
    rec = inp.record
    ranges = []
    for lo in sorted(inp.ranges):
        r = inp.ranges[lo]
        per_count = {}
        # counts the learner does not time: past a count slower than the fastest
        at_one_size = sized(r) if r.tokens else r.samples  # as the learner has them
        skipped = past_a_slower_count(at_one_size, inp.counts)
        # ... or out of the host's cores' reach, as the learner has it (R4.12)
        unreachable = inp.unreachable.get(lo, {})
        for n in inp.counts:
            s, e = summarize(r.samples.get(n, [])), estimate(r.samples.get(n, []))
            why = "past a slower count" if n in skipped else unreachable.get(n)
            # what the learner compared: each sample as a forward of the range's smallest
            # size (a live worker; a record keeps no sizes)
            sized_e = estimate(at_one_size.get(n, [])) if r.tokens else None
            per_count[str(n)] = {
                **({"median_ms": round(s.median_ms, 3),
                    "interval_ms": [round(e.low_ms, 3), round(e.high_ms, 3)],
                    "p90_ms": round(s.p90_ms, 3), "samples": s.samples} if s else
                   {"median_ms": None, "interval_ms": None, "p90_ms": None, "samples": 0,
                    **({"not_timed": why} if why else {})}),
                **({"at_smallest_size_ms": {
                    "median_ms": round(sized_e.ms, 3),
                    "interval_ms": [round(sized_e.low_ms, 3), round(sized_e.high_ms, 3)]}}
                   if sized_e else {}),
                **({"refused": r.refused[n]} if r.refused.get(n) else {}),
                **({"out_of_reach": unreachable[n]} if n in unreachable else {})}
        served = inp.configured if rec.drift is not None or rec.locked_reason else \
            wanted_count(r, inp.configured)
        # as the learner has it: at one size (a record's report: its stored ms)
        up = speedup(at_one_size, inp.configured, r.learned) if r.learned else None
        ranges.append({"size_range": f"{lo}-{2 * lo - 1}", "served_threads": served,
                       "counts": per_count, "learned_threads": r.learned,
                       "speedup": round(up, 3) if up else None,
                       "verified_passes": inp.verified_passes.get(lo, 0),
                       "state": range_state(inp, r).value,
                       "learned_from": r.learned_from,  # "own" samples, or a "sibling"'s
                       "timed_by": "its served forwards, at each count in turn (mode 2, "
                                   "vouched)" if r.explore_served else
                                   "shadows, and its served forwards at the count served"})
    notes = []
    if inp.mode is AdaptiveMode.SERVE and not rec.voucher.vouches:
        bad = rec.voucher.mismatches + rec.voucher.shape_mismatches
        notes.append("mode 2 acts as mode 1: the host record has no voucher of bit-identity "
                     "across counts for this host, revision and backend (shadows verify the "
                     "shapes traffic brings, one by one; `vllm-srun threads verify` sweeps "
                     "them up front)" + (f"; {bad} mismatches recorded" if bad else "")
                     + (f"; {rec.voucher.legacy} sweep(s) from before sweeps recorded what they "
                        "covered vouch for nothing" if rec.voucher.legacy else ""))
    if inp.mode is AdaptiveMode.SERVE and inp.uncovered:
        notes.append(f"{inp.uncovered} forwards ran at the configured count where another was "
                     "due: no sweep covered their shape and count, nor was that shape verified "
                     "yet (a shadow verifies it)")
    if rec.drift is not None and rec.scope.backend == "torch":
        notes.append(CBWR_REMEDY)
    if rec.locked_reason:
        notes.append(rec.locked_reason)
    if inp.shadow_error:
        notes.append(inp.shadow_error)
    if rec.error:
        notes.append(f"host record not written, learning kept in memory: {rec.error}")
    return advised({
        "deployment": None, "replica": None, "model": inp.model,
        "mode": int(inp.mode), "configured_threads": inp.configured,
        "allowed_counts": list(inp.counts),
        "scope": {"fingerprint": rec.scope.fingerprint, "revision": rec.scope.revision,
                  "backend": rec.scope.backend, "precision": rec.scope.precision},
        "record": rec.path,
        "voucher": {"comparisons": rec.voucher.comparisons,
                    "mismatches": rec.voucher.mismatches, "swept": rec.voucher.swept,
                    "vouches": rec.voucher.vouches,
                    "coverage": [{**asdict(c), "counts": list(c.counts)}
                                 for c in rec.voucher.coverages],
                    # count -> shapes verified one by one against the configured count
                    "shapes_verified": {str(n): k for n, k in
                                        rec.voucher.shapes_verified(inp.configured).items()},
                    "shape_mismatches": rec.voucher.shape_mismatches},
        "uncovered_forwards": inp.uncovered,
        "learning": inp.learning,
        "drift": None if rec.drift is None else {
            "worker": rec.drift.worker or None,
            "seen_at": _utc(rec.drift.created_at) if rec.drift.created_at else None,
            "rows": rec.drift.rows or None,
            "padded_length": (rec.drift.padded_tokens // rec.drift.rows
                              if rec.drift.rows else None),
            "padded_tokens": rec.drift.padded_tokens,
            "served_threads": rec.drift.served_threads,
            "shadow_threads": rec.drift.shadow_threads,
            "first_index": list(rec.drift.first_index),
            "served_value": rec.drift.served_value, "shadow_value": rec.drift.shadow_value},
        "locked_reason": rec.locked_reason,
        "decision_statistic": DECISION_STATISTIC, "decision_per": DECISION_PER,
        "decision_margin": inp.decision.margin,
        "decision_min_samples": inp.decision.min_samples,
        "notes": notes,
        "ranges": ranges,
    })


def advised(report: dict) -> dict:
    """``report`` with its learning state, the reason, and the recommendation, up front."""
    state, reason = learning_state(report)
    head = {k: report.pop(k) for k in ("deployment", "replica", "model", "mode")}
    return {**head, "state": state.value, "state_reason": reason,
            "recommendation": recommendation(report | head, state), **report}


def off_report(configured: int | None, note: str = OFF_REASON,
               model: str | None = None) -> dict:
    """The report of a worker that learns nothing (adaptive threads off, a GPU or attached
    replica, one that did not answer): the same keys as ``build``'s, state ``locked``."""
    return advised({
        "deployment": None, "replica": None, "model": model, "mode": 0,
        "configured_threads": configured,
        "allowed_counts": [configured] if configured is not None else [],
        "scope": None, "record": None,
        "voucher": {"comparisons": 0, "mismatches": 0, "swept": 0, "vouches": False,
                    "coverage": [], "shapes_verified": {}, "shape_mismatches": 0},
        "uncovered_forwards": 0, "learning": {}, "drift": None, "locked_reason": note,
        "decision_statistic": DECISION_STATISTIC, "decision_per": DECISION_PER,
        "decision_margin": None,
        "decision_min_samples": None, "notes": [note], "ranges": []})


def document(reports: list[dict], source: str) -> dict:
    """The one JSON shape of ``GET /v1/threads`` (source ``server``) and ``vllm-srun threads
    report --json`` (source ``record``)."""
    return {"object": "threads.report", "source": source, "reports": reports}


def labelled(report: dict, deployment: str | None, replica: str | None) -> dict:
    """A replica's report named by its deployment and replica id; anything that is not a
    report (a replica that manages its own threads, or did not answer) becomes one."""
    if "ranges" not in report or "state" not in report:
        note = "; ".join(report.get("notes", [])) or str(report.get("error", "no report"))
        report = off_report(None, note)
    return {**report, "deployment": deployment, "replica": replica}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
