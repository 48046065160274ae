"""R4.12 without breaking R4.11: workers of one scope start from what a live sibling learned,
and verify it themselves; rows of writers that are gone, or stale, or from before writers were
recorded, are history. Real SQLite records, the real L6 tuner on onnxruntime (its forward times
scaled at some counts by ``SlowerAt``, so which count wins does not hang on this shared host's
noise; every answer and every bit-for-bit check is the real model's)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import (
    FAST,
    L6,
    SlowerAt,
    record_at_schema,
    row,
    run_cli,
    serve_paced,
    start,
    wait_for,
)
from vllm_srun.records.host_record import DriftEvent, HostRecord, Scope
from vllm_srun.records.schema import SCHEMA_VERSION
from vllm_srun.records.voucher import Coverage
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.tuner.adaptive import AdaptiveThreads
from vllm_srun.tuner.estimator import past_a_slower_count
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import Pending
from vllm_srun.tuner.ranges import Phase
from vllm_srun.tuner.report import build, from_tuner
from vllm_srun.tuner.siblings import LIVE_S, SiblingCount, siblings_learned, starting_counts
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep

M = resolve(L6)
SCOPE = Scope("test-host", M.revision, "onnxruntime")
COUNTS = (1, 2, 3)
# the change detector (R4.11) off: this loaded host's noise must not relearn a range mid-test
STEADY = FAST.with_(relearn_factor=1000.0)
# one row of up to 256 tokens at counts 1-3, as a sweep would vouch (onnxruntime is
# bit-identical across counts here, FACTS.md; every shadow still checks it bit for bit)
SWEEP = plan_sweep(ShapeBounds(1, 256, 256)).coverage(COUNTS)


@pytest.fixture(scope="module")
def onnx():
    return load_backend(M, "onnxruntime")


def two_wins(backend):
    """2 threads run 5x faster than 1 and 3 (forward times as the tuner reads them)."""
    return SlowerAt(SlowerAt(backend, 1, 5.0), 3, 5.0)


def unstarted(record: HostRecord, mode=AdaptiveMode.LEARN) -> AdaptiveThreads:
    """A tuner of ``SCOPE`` on ``record``, not started (it reads the record as it is made)."""
    def no_forward(batch, n):
        raise AssertionError("no forward runs in this test")

    return AdaptiveThreads(mode, 1, COUNTS, SCOPE, record, no_forward, FAST)


def learned_by(tuner: AdaptiveThreads, lo: int = 64, n: int = 2) -> None:
    """``tuner`` writes that it learned ``n`` for range ``lo`` as its flush does."""
    tuner.sync.write(Pending(learned={lo}), {lo: (n, 5.0, 3, "own")}, 1)


def past(path, writer: str, seconds: float) -> None:
    """The writer's last heartbeat, moved ``seconds`` into the past (a killed worker's)."""
    with sqlite3.connect(path) as db:
        db.execute("UPDATE writers SET seen_at = seen_at - ? WHERE writer = ?",
                   [seconds, writer])


# -- which rows count --------------------------------------------------------------------

def test_only_live_other_writers_of_the_scope_count_and_bad_rows_are_skipped(tmp_path, caplog):
    """R4.12: a row counts while its writer is live (seen within ``LIVE_S``, its pid running)
    and is not the reader; rows of a stale, gone or dead-pid writer, of another scope, or
    from before writers were recorded do not; a corrupt row is skipped with a log line."""
    path = tmp_path / "r.sqlite"
    record = HostRecord(path)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    other_scope = Scope("test-host", M.revision, "torch")
    writers = {"me": (SCOPE, 16), "live": (SCOPE, 32), "stale": (SCOPE, 64),
               "gone": (SCOPE, 128), "dead": (SCOPE, 256), "other": (other_scope, 512),
               "bad": (SCOPE, 1024)}
    for writer, (scope, lo) in writers.items():
        record.note_writer(scope, writer, ended.pid if writer == "dead" else os.getpid(), 0.0)
        record.put_learned(scope, lo, 2, 1.5, 3, writer, "own")
    record.put_learned(SCOPE, 2048, 2, 1.5, 3)  # before writers were recorded: no writer
    record.note_writer(SCOPE, "no-pid", 0, 0.0)  # a foreign row: pid 0 names no process
    record.put_learned(SCOPE, 4096, 2, 1.5, 3, "no-pid", "own")
    record.writer_gone("gone")
    past(path, "stale", LIVE_S + 1)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE learned SET num_threads = 'x' WHERE writer = 'bad'")
    with caplog.at_level(logging.WARNING, "vllm_srun.tuner.siblings"):
        found = siblings_learned(HostRecord(path), SCOPE, me="me")
    assert found.keys() == {32}
    assert found[32].num_threads == 2 and found[32].writer == "live"
    assert "sibling_row_skipped" in caplog.text and "'bad'" in caplog.text


def test_starting_counts_are_the_siblings_counts_this_worker_may_run():
    siblings = {16: SiblingCount(2, 1.4, 100.0, 3, "a"), 32: SiblingCount(1, 1.0, 100.0, 3, "a"),
                64: SiblingCount(8, 1.9, 100.0, 3, "b")}
    assert starting_counts(siblings, (1, 2, 4), configured=1) == {16: 2}  # 32 configured,
    # 64 not among its counts


# -- (a) a live sibling's count is the starting point, verified --------------------------

def test_a_worker_starts_from_a_live_siblings_count_and_serves_it_after_its_own_window(
        onnx, tmp_path):
    """R4.12, R4.13: A (mode 1, configured 2) explores 1, 2 and 3 and learns 1. B (mode 2)
    started on the same record and scope while A is live times only 1 against the configured
    2 (no shadow at 3 before it learned), learns 1 from its own samples, and serves it only
    for forwards that come after its own transition window passed in its ledger; the report
    says the count came from a sibling. (1 is the fast count: 2-thread forwards on this
    loaded 2-vCPU host vary by more than 5x. 50x: the in-process idle-class shadows of a
    test are timed by their wall time, and beside the served count's spinning pool threads a
    1-thread shadow here once took over 5x a 2-thread forward.)"""
    record = HostRecord(tmp_path / "r.sqlite")
    record.add_voucher(SCOPE, "verify", 40, 0, SWEEP)
    backend = SlowerAt(SlowerAt(onnx, 2, 50.0), 3, 50.0)
    runner_a, a = start(backend, record, AdaptiveMode.LEARN, 2, COUNTS, STEADY)
    try:
        for i in range(120):  # (a busy host takes more: a shadow that mostly waited times nothing)
            serve_paced(runner_a, a, row(100, i))
            if a.learner.ranges[64].learned is not None:
                break
        assert a.learner.ranges[64].learned == 1 and len(a.learner.ranges[64].samples[3]) >= 3
        assert wait_for(lambda: 64 in siblings_learned(record, SCOPE, me="reader"))
        runner_b, b = start(backend, record, AdaptiveMode.SERVE, 2, COUNTS, STEADY)
        try:
            r = b.learner.ranges[64]
            assert r.candidate == 1 and b.learner.need(r) == [2, 1]  # before any traffic
            served_before_window = served_after_window = 0
            timed_at_three = None  # B's samples at 3 when it learned (after: probes, R4.11)
            for i in range(120):
                passed = b.ledger.window_passed(64, 1)
                serve_paced(runner_b, b, row(100, 100 + i))
                at_one = runner_b.served[-1].num_threads == 1
                served_before_window += at_one and not passed
                served_after_window += at_one and passed
                if timed_at_three is None and (r := b.learner.ranges[64]).learned is not None:
                    timed_at_three = len(r.samples.get(3, []))
                if served_after_window >= 3:
                    break
            r = b.learner.ranges[64]
            assert (r.learned, r.phase, r.learned_from) == (1, Phase.SERVING, "sibling")
            assert served_before_window == 0 and served_after_window >= 3
            assert timed_at_three == 0 and len(r.samples[1]) >= FAST.learning.min_samples
            assert b.ledger.progress(64, 1) >= FAST.learning.window
            (b_row,) = [x for x in build(from_tuner(b))["ranges"] if x["size_range"] == "64-127"]
            (a_row,) = [x for x in build(from_tuner(a))["ranges"] if x["size_range"] == "64-127"]
            assert (b_row["learned_from"], a_row["learned_from"]) == ("sibling", "own")
        finally:
            runner_b.stop()
        with sqlite3.connect(tmp_path / "r.sqlite") as db:
            assert db.execute("SELECT num_threads, origin FROM learned WHERE writer = ?",
                              [b.sync.writer]).fetchall() == [(1, "sibling")]
    finally:
        runner_a.stop()


def test_a_range_a_sibling_learns_later_is_taken_up_at_the_next_record_read(tmp_path):
    """R4.12: B started before A learned; the record watch's next read (``poll_record``)
    gives B's range A's count as its candidate, and says B lives."""
    record = HostRecord(tmp_path / "r.sqlite")
    a, b = unstarted(record), unstarted(record)
    assert b.learner.ranges == {}
    learned_by(a)
    b.poll_record()
    assert b.learner.ranges[64].candidate == 2
    assert siblings_learned(record, SCOPE, me=a.sync.writer) == {}  # B learned nothing yet
    assert b.sync.writer in {w for (w,) in sqlite3.connect(tmp_path / "r.sqlite").execute(
        "SELECT writer FROM writers")}


def test_a_candidate_its_own_timing_rejects_sends_the_range_exploring(onnx, tmp_path):
    """R4.12, R4.13: a live sibling learned 2, but here 2 runs 5x slower than the configured
    1: by the estimator's rule on its own samples the worker rejects 2, explores from its own
    samples and learns 1; the sibling's count is not taken up again. 3 lies past 2, which ran
    slower than 1, so it is not timed (``estimator.past_a_slower_count``)."""
    record = HostRecord(tmp_path / "r.sqlite")
    learned_by(unstarted(record))
    runner, b = start(SlowerAt(onnx, 2, 5.0), record, AdaptiveMode.LEARN, 1, COUNTS, STEADY)
    try:
        assert b.learner.ranges[64].candidate == 2
        for i in range(20):
            serve_paced(runner, b, row(100, i))
            if b.learner.ranges[64].learned is not None:
                break
        b.poll_record()
        r = b.learner.ranges[64]
        assert r.candidate is None and r.rejected == {2} and r.learned_from == "own"
        assert len(r.samples[1]) >= FAST.learning.min_samples and r.learned == 1
        assert not r.samples.get(3) and past_a_slower_count(r.samples, COUNTS) == {3}
    finally:
        runner.stop()


# -- (b) rows of writers that are gone are history (R4.11) -------------------------------

@pytest.mark.parametrize("how", ["stopped", "stale"])
def test_a_gone_siblings_rows_are_ignored_and_the_worker_explores_from_zero(onnx, tmp_path,
                                                                           how):
    """R4.11: A learned 2 for range 64 (written as its flush writes it); while A is live a
    new tuner starts from it (the control). Once A is stopped, or its last heartbeat is older
    than ``LIVE_S`` (a killed worker: its row is never refreshed again), a new worker, alone
    on the scope, explores every count from fresh samples, at start and at each record read."""
    path = tmp_path / "r.sqlite"
    record = HostRecord(path)
    a = unstarted(record)
    learned_by(a)
    assert unstarted(record).learner.ranges[64].candidate == 2  # A live: the control
    if how == "stopped":
        a.close()
    else:
        past(path, a.sync.writer, LIVE_S + 1)
    runner, b = start(two_wins(onnx), record, AdaptiveMode.LEARN, 1, COUNTS)
    try:
        assert b.learner.ranges == {}
        b.poll_record()
        serve_paced(runner, b, row(100))
        r = b.learner.ranges[64]
        assert r.candidate is None and b.learner.explored(r) == COUNTS
        assert 3 in r.samples and r.learned_from in (None, "own")  # it timed 3 itself
    finally:
        runner.stop()


# -- (c) a record from before writers were recorded --------------------------------------

def test_a_schema_5_record_opens_and_keeps_vouchers_drift_and_learned_rows(tmp_path):
    """R4.9: a record of schema 5 (learned rows without a writer, no writers table) migrates;
    its voucher, drift and learned counts read as before, its learned rows are no live
    sibling's, and a tuner of the new schema writes beside them."""
    path = tmp_path / "r.sqlite"
    conn = record_at_schema(path, 5)
    key = ["test-host", M.revision, "onnxruntime", "float32"]
    conn.execute("INSERT INTO vouchers (fingerprint, revision, backend, precision, source, "
                 "comparisons, mismatches, created_at, coverage) VALUES (?, ?, ?, ?, 'verify', "
                 "40, 0, 1.0, ?)", [*key, SWEEP.to_json()])
    conn.execute("INSERT INTO drift (fingerprint, revision, backend, precision, padded_tokens, "
                 "served_threads, shadow_threads, first_index, served_value, shadow_value, "
                 "created_at, rows, worker) VALUES (?, ?, ?, ?, 7, 2, 1, ?, 0.5, 0.25, 2.0, 1, "
                 "'pid 9')", [*key, json.dumps([0, 3])])
    conn.execute("INSERT INTO learned (fingerprint, revision, backend, precision, size_lo, "
                 "num_threads, speedup, verified_passes, updated_at) VALUES "
                 "(?, ?, ?, ?, 64, 2, 1.8, 9, 3.0)", key)
    conn.close()
    record = HostRecord(path)
    assert record.quarantined is None
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    voucher = record.voucher(SCOPE)
    assert voucher.vouches and voucher.coverages == (Coverage.from_json(SWEEP.to_json()),)
    assert record.drift(SCOPE) == DriftEvent(7, 2, 1, (0, 3), 0.5, 0.25, 2.0, 1, "pid 9")
    assert record.learned(SCOPE) == {64: {"size_lo": 64, "num_threads": 2, "speedup": 1.8,
                                          "verified_passes": 9, "updated_at": 3.0,
                                          "writer": "", "origin": None}}
    assert siblings_learned(record, SCOPE, me="reader") == {}
    tuner = unstarted(record, AdaptiveMode.SERVE)
    assert tuner.learner.ranges == {} and tuner.ledger.retired == record.drift(SCOPE)
    assert tuner.ledger.voucher == voucher
    learned_by(tuner, 64, 3)
    assert record.learned(SCOPE)[64]["num_threads"] == 3  # the newest row per range
    with sqlite3.connect(path) as db:
        assert sorted(db.execute("SELECT writer, num_threads FROM learned")) == [
            ("", 2), (tuner.sync.writer, 3)]


def test_the_record_report_says_where_each_learned_count_came_from(tmp_path):
    """R4.10: ``vllm-srun threads report`` from the record says per range ``learned_from``:
    "sibling" for a count a worker took from a live sibling and verified, "own" for one it
    explored (and for rows from before origins were recorded: no worker took a sibling's
    count then), none where nothing was learned."""
    path = tmp_path / "r.sqlite"
    record = HostRecord(path)
    for lo in (16, 32, 64, 128):
        record.add_samples(SCOPE, lo, 1, [1.0])
    record.put_learned(SCOPE, 16, 2, 1.5, 3, "a", "own")
    record.put_learned(SCOPE, 32, 2, 1.5, 3, "b", "sibling")
    record.put_learned(SCOPE, 64, 2, 1.5, 3)  # from before writers were recorded
    out = run_cli("threads", "report", "--record", str(path), "--json")
    assert out.returncode == 0, out.stderr
    (rep,) = json.loads(out.stdout)["reports"]
    assert {r["size_range"]: r["learned_from"] for r in rep["ranges"]} == {
        "16-31": "own", "32-63": "sibling", "64-127": "own", "128-255": None}
