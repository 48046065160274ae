"""R4.10: one threads-report shape everywhere, with the learning state, the statistic the
decision uses and a recommendation. Reports are built from recorded samples (ReportInput is
plain data); the offline path reads a real SQLite record through the real CLI; a restarted
worker's tuner reads a real record."""

from __future__ import annotations

import io
import json

import numpy as np

from tests.conftest import run_cli
from vllm_srun.records.host_record import Coverage, DriftEvent, HostRecord, Scope, Voucher
from vllm_srun.server.frontend.progress import Progress, clock_text, eta_s
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.estimator import choose, estimate
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.ranges import Phase, RangeLearning
from vllm_srun.tuner.report import (
    DECISION_STATISTIC,
    DecisionRule,
    RecordState,
    ReportInput,
    build,
    document,
    labelled,
    off_report,
)
from vllm_srun.tuner.report_view import table, tables
from vllm_srun.tuner.samples import at_size

SCOPE = Scope("test-host", "rev1", "onnxruntime")
S = TunerSettings()
# one count at 10 ms in a quiet quarter of its samples and 40 ms the rest (a neighbour came
# and went), the other at 15 ms throughout: the median (the load the worker sees) picks the
# second, where the lower quartile ("a quiet host") picked the first
NOISY = [10.0] * 4 + [40.0] * 8
STEADY = [15.0] * 12
FAST = [10.0] * 12


def report(mode=AdaptiveMode.LEARN, learned=None, serving=False, voucher=Voucher(0, 0, False),
           drift=None, locked=None, samples=None) -> dict:
    phase = Phase.EXPLORING if learned is None else Phase.SERVING if serving else \
        Phase.VERIFYING if mode is AdaptiveMode.SERVE and learned != 1 else Phase.LEARNED
    r = RangeLearning(phase, samples=samples if samples is not None else {1: STEADY, 2: FAST},
                      learned=learned)
    return build(ReportInput(mode, 1, (1, 2), {32: r}, RecordState(SCOPE, voucher, drift, locked),
                             DecisionRule(S.learning.margin, S.learning.min_samples),
                             verified_passes={32: S.learning.window if serving else 0}))


def test_the_decision_statistic_is_named_and_is_the_one_the_decision_uses():
    """R4.13: the report names the median and gives it per count with its interval and the
    p90; the learned count follows it: a count fast in a quiet third of its samples only
    does not win (its interval reaches under the bar at 12 samples, so it is decided at the
    48 a decision rests on, by the medians)."""
    samples = {1: STEADY * 4, 2: NOISY * 4}
    rule = S.learning
    rep = report(learned=choose(samples, (1, 2), 1, rule.min_samples, rule.margin,
                                rule.max_samples),
                 samples=samples)
    (rng,) = rep["ranges"]
    assert rep["decision_statistic"] == DECISION_STATISTIC == "median_ms"
    assert rep["decision_per"] == "range_smallest_size"  # each sample sized to its range's
    e = estimate(NOISY * 4)
    assert rng["counts"]["2"] == {"median_ms": 40.0, "interval_ms": [e.low_ms, e.high_ms],
                                  "p90_ms": 40.0, "samples": 48}
    assert rng["counts"]["1"]["median_ms"] == 15.0
    assert rng["learned_threads"] == 1 and rng["speedup"] == 1.0
    assert "median [80% interval]/p90/n" in table(rep) and "40.00 [" in table(rep)


def test_a_live_report_shows_what_the_learner_compared_at_one_size():
    """R4.13: beside each count's median in ms, a live worker's report gives the median and
    interval of its samples as forwards of the range's smallest size, the figures the rule
    decided on (here 2 threads ran the long inputs of the range and 1 the short: in ms 2
    reads slower, at one size faster); a record's report keeps no sizes and has none."""
    tokens = {1: [32] * 6 + [40] * 6, 2: [60] * 6 + [63] * 6}
    samples = {1: [10.0] * 6 + [12.5] * 6, 2: [15.0] * 6 + [15.75] * 6}
    r = RangeLearning(Phase.LEARNED, samples=samples, tokens=tokens, learned=2)
    rep = build(ReportInput(AdaptiveMode.LEARN, 1, (1, 2), {32: r},
                            RecordState(SCOPE, Voucher(0, 0, False), None, None),
                            DecisionRule(S.learning.margin, S.learning.min_samples)))
    (rng,) = rep["ranges"]
    at = {n: rng["counts"][str(n)]["at_smallest_size_ms"] for n in (1, 2)}
    sized = at_size(samples, tokens, 32)
    for n in (1, 2):
        e = estimate(sized[n])
        assert at[n] == {"median_ms": round(e.ms, 3),
                         "interval_ms": [round(e.low_ms, 3), round(e.high_ms, 3)]}
    assert rng["counts"]["2"]["median_ms"] > rng["counts"]["1"]["median_ms"]
    assert at[2]["median_ms"] < at[1]["median_ms"]
    assert choose(sized, (1, 2), 1, 12, 0.05, 48) == 2
    stored = RangeLearning(Phase.LEARNED, samples=samples, learned=2)
    rep = build(ReportInput(AdaptiveMode.LEARN, 1, (1, 2), {32: stored},
                            RecordState(SCOPE, Voucher(0, 0, False), None, None),
                            DecisionRule(S.learning.margin, S.learning.min_samples)))
    assert "at_smallest_size_ms" not in rep["ranges"][0]["counts"]["1"]


def test_states_and_recommendations():
    """locked (mode off, golden check), learning, serving, retired: each with its advice."""
    assert off_report(2)["state"] == "locked"
    assert "VLLM_SRUN_CPU_ADAPTIVE_THREADS=1" in off_report(2)["recommendation"]
    locked = report(locked="golden check failed: answers differ")
    assert (locked["state"], locked["state_reason"]) == ("locked", "golden check failed: "
                                                                    "answers differ")
    exploring = report(samples={1: STEADY[:3]})
    assert exploring["state"] == "learning"
    assert exploring["recommendation"].startswith("keep learning: none of 1 ranges")
    mode1 = report(learned=2)
    assert mode1["state"] == "learning"
    assert mode1["recommendation"].startswith("set --threads 2 for this traffic: every "
                                              "learned range runs fastest at 2 (32-63 1.50x)")
    assert "after `vllm-srun threads verify`" in mode1["recommendation"]
    kept = report(learned=1, samples={1: STEADY, 2: STEADY})
    assert kept["recommendation"] == ("keep --threads 1: no other count beat it by 5% in the "
                                      "1 learned ranges")
    vouched = Voucher(10, 0, True, (Coverage((1, 2), 1, 2, 64, 64, 64, 63),))
    serving = report(AdaptiveMode.SERVE, learned=2, serving=True, voucher=vouched)
    assert serving["state"] == "serving"
    assert serving["recommendation"].startswith("keep mode 2 on: it serves learned counts in "
                                                "1 of 1 ranges (up to 1.50x")
    drift = DriftEvent(7, 2, 1, (0, 0), 0.0, 1.0, 0.0, 1, "replica w0 pid 9")
    retired = report(AdaptiveMode.SERVE, learned=2, serving=True, voucher=vouched, drift=drift)
    assert retired["state"] == "retired" and "replica w0 pid 9" in retired["state_reason"]
    assert retired["recommendation"].startswith("keep --threads 1: answers are not "
                                                "bit-identical")
    assert retired["ranges"][0]["served_threads"] == 1


def test_every_report_has_the_same_keys():
    """One shape: a learning worker's report, an off one and a replica that manages its own
    threads (a GPU or attached one) have the same keys, in the same document."""
    keys = list(report(learned=2))
    assert list(off_report(1)) == keys
    doc = document([labelled(report(learned=2), "primary", "w0"),
                    labelled({"notes": ["gpu replicas manage their own threads"]},
                             "primary", "g0")], "server")
    assert list(doc) == ["object", "source", "reports"] and doc["object"] == "threads.report"
    assert [list(r) for r in doc["reports"]] == [keys, keys]
    assert [(r["deployment"], r["replica"], r["state"]) for r in doc["reports"]] == \
        [("primary", "w0", "learning"), ("primary", "g0", "locked")]
    assert "gpu replicas manage their own threads" in doc["reports"][1]["state_reason"]
    assert "deployment primary, replica w0" in tables(doc)


def test_a_worker_restarted_after_drift_reports_retired(tmp_path):
    """R4.7: drift recorded with the record API; a new worker's tuner (before its golden
    check: it never explores again) and the offline report both say ``retired``."""
    record = HostRecord(tmp_path / "r.sqlite")
    record.note_worker(SCOPE, "model-x", 2, 1, [1, 2])
    record.add_samples(SCOPE, 32, 1, STEADY)
    record.record_drift(SCOPE, DriftEvent(7, 2, 1, (0, 3), 0.5, 0.25, 9.0, 1, "pid 1"))

    def never(_batch, _n):  # the tuner must not forward anything before its golden check
        raise AssertionError("forwarded")

    tuner = AdaptiveThreads(AdaptiveMode.SERVE, 1, (1, 2), SCOPE, record, never,
                            TunerSettings.of(background=False))
    from vllm_srun.tuner.report import from_tuner

    live = build(from_tuner(tuner))
    assert live["state"] == "retired" and live["drift"]["worker"] == "pid 1"
    r = run_cli("threads", "report", "--record", str(record.path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["object"], doc["source"]) == ("threads.report", "record")
    (off,) = doc["reports"]
    assert (off["state"], off["model"], off["mode"]) == ("retired", "model-x", 2)
    assert list(off) == list(live)
    text = run_cli("threads", "report", "--record", str(record.path)).stdout
    assert "state: retired" in text and "recommendation: keep --threads 1" in text


def test_progress_lines_and_eta():
    """``threads verify``: off a terminal, a line every few seconds with done/total, elapsed
    and ETA (by work done), and a summary; on a terminal, a bar redrawn in place."""
    now = [0.0]
    out = io.StringIO()
    p = Progress("verify", 100, out, every_s=5, clock=lambda: now[0], tty=False)
    for t, done in ((1, 10), (6, 25), (7, 30), (12, 75)):
        now[0] = t
        p.update(done, f"{done}/100 shapes")
    now[0] = 15
    p.finish("100/100 shapes")
    assert out.getvalue().splitlines() == [
        "verify: 25/100 shapes; 25%, elapsed 0:06, ETA 0:18",
        "verify: 75/100 shapes; 75%, elapsed 0:12, ETA 0:04",
        "verify: 100/100 shapes in 0:15"]
    tty = io.StringIO()
    p = Progress("verify", 4, tty, clock=lambda: now[0], tty=True)
    now[0] += 1
    p.update(2, "2/4 shapes")
    assert tty.getvalue().startswith("\rverify: [############............] 2/4 shapes; 50%")
    assert (eta_s(10, 0, 5), clock_text(3725), clock_text(None)) == (None, "1:02:05", "?")
    assert np.isclose(eta_s(10, 1, 5), 40)


def test_a_count_past_a_slower_one_is_reported_as_not_timed():
    """With counts 1, 2, 4 and 2 slower than the configured 4, 1 is never timed: the report
    says why instead of a bare dash."""
    r = RangeLearning(Phase.EXPLORING, samples={4: [10.0] * 12, 2: [14.0] * 12})
    rep = build(ReportInput(AdaptiveMode.LEARN, 4, (1, 2, 4), {32: r},
                            RecordState(SCOPE, Voucher(0, 0, False), None, None),
                            DecisionRule(S.learning.margin, S.learning.min_samples)))
    counts = rep["ranges"][0]["counts"]
    assert counts["1"] == {"median_ms": None, "interval_ms": None, "p90_ms": None,
                           "samples": 0, "not_timed": "past a slower count"}
    assert "not_timed" not in counts["2"] and "past slower" in table(rep)


def test_a_count_the_core_ledger_kept_out_of_reach_is_reported_as_refused():
    """R4.12: a count the host's core ledger served lower more often than it was timed is
    no longer timed (``estimator.out_of_reach``); the report says so and how often."""
    r = RangeLearning(Phase.EXPLORING, samples={1: [14.0] * 12, 2: [10.0] * 12},
                      refused={4: 3})
    rep = build(ReportInput(AdaptiveMode.SERVE, 2, (1, 2, 4), {32: r},
                            RecordState(SCOPE, Voucher(0, 0, False), None, None),
                            DecisionRule(S.learning.margin, S.learning.min_samples),
                            unreachable={32: {4: "the core ledger refused it"}}))
    counts = rep["ranges"][0]["counts"]
    assert counts["4"] == {"median_ms": None, "interval_ms": None, "p90_ms": None,
                           "samples": 0, "not_timed": "the core ledger refused it",
                           "refused": 3, "out_of_reach": "the core ledger refused it"}
    assert "refused" not in counts["2"] and "refused" in table(rep)
