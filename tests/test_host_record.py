"""R4.9: the SQLite host record: WAL, concurrent writers, kills, quarantine, migration."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from tests.conftest import record_at_schema
from vllm_srun.records.host_record import (
    Coverage,
    DriftEvent,
    HostRecord,
    HostRecordError,
    Scope,
)
from vllm_srun.records.schema import APPLICATION_ID, SCHEMA_VERSION

SCOPE = Scope("f00d", "rev1", "onnxruntime")
# a sweep at counts 1 and 2 of 1-4 rows x 2-128 tokens, up to 256 padded tokens, all of it
SWEPT = Coverage((1, 2), 4, 2, 128, 256, 1024, 500)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "record.sqlite"


def test_new_record_is_ours_in_wal_mode(path):
    HostRecord(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_learnings_survive_reopening(path):
    r = HostRecord(path)
    r.put_golden(SCOPE, "abc")
    r.add_samples(SCOPE, 8, 1, [1.0, 2.0])
    r.add_samples(SCOPE, 8, 1, [3.0])
    r.put_learned(SCOPE, 8, 2, 1.4, 9)
    r.add_voucher(SCOPE, "verify", 10, 0, SWEPT)
    r.close()
    r = HostRecord(path)
    assert r.golden(SCOPE) == "abc"
    assert r.timings(SCOPE) == {8: {1: [1.0, 2.0, 3.0]}}
    assert r.learned(SCOPE)[8]["num_threads"] == 2
    assert r.voucher(SCOPE).vouches and r.voucher(SCOPE).coverages == (SWEPT,)
    assert r.golden(Scope("other", "rev1", "onnxruntime")) is None


def test_drift_retires_until_reset_and_reset_keeps_history(path):
    r = HostRecord(path)
    r.add_samples(SCOPE, 8, 1, [1.0])
    event = DriftEvent(7, 2, 1, (0, 17), 0.25, 0.2500001, 123.0, 1, "replica r1 pid 42")
    r.record_drift(SCOPE, event)
    assert HostRecord(path).drift(SCOPE) == event
    r.reset(SCOPE)
    assert r.drift(SCOPE) is None and r.timings(SCOPE) == {}
    rows = sqlite3.connect(path).execute("SELECT count(*) FROM drift").fetchone()[0]
    assert rows == 1


def test_traffic_comparisons_alone_do_not_vouch(path):
    """R4.8: traffic's comparison counts add to a sweep's but vouch for nothing by
    themselves (only shapes verified one by one do, each for itself)."""
    r = HostRecord(path)
    r.add_voucher(SCOPE, "traffic", 500, 0)
    assert not r.voucher(SCOPE).vouches
    r.add_voucher(SCOPE, "verify", 40, 0, SWEPT)
    assert r.voucher(SCOPE).vouches and r.voucher(SCOPE).comparisons == 540
    r.add_voucher(SCOPE, "traffic", 1, 1)
    assert not r.voucher(SCOPE).vouches


def test_a_sweep_that_compared_nothing_vouches_for_nothing(path):
    """R4.8: an empty sweep, then traffic, still vouches for nothing."""
    r = HostRecord(path)
    r.add_voucher(SCOPE, "verify", 0, 0, SWEPT)
    r.add_voucher(SCOPE, "traffic", 500, 0)
    v = r.voucher(SCOPE)
    assert (v.vouches, v.swept, v.coverages) == (False, False, ())
    assert not v.covers(1, 8, 2, 1)
    with pytest.raises(ValueError, match="what it covered"):
        r.add_voucher(SCOPE, "verify", 10, 0)


def test_voucher_covers_only_its_counts_and_shapes(path):
    """R4.8: a sweep at {1, 2} vouches for neither 4 threads nor shapes outside its bounds."""
    r = HostRecord(path)
    r.add_voucher(SCOPE, "verify", 500, 0, SWEPT)
    v = r.voucher(SCOPE)
    assert v.covers(1, 128, 2, 1) and v.covers(4, 64, 1, 2) and v.covers(1, 2, 2, 1)
    assert not v.covers(1, 64, 4, 1)  # count never swept
    assert not v.covers(1, 64, 2, 4)  # configured count never swept
    assert not v.covers(5, 8, 2, 1)  # more rows than swept
    assert not v.covers(3, 100, 2, 1)  # 300 padded tokens: above the swept 256
    assert not v.covers(1, 129, 2, 1)  # longer than swept
    assert not v.covers(1, 1, 2, 1)  # shorter than swept
    r.add_voucher(SCOPE, "verify", 9, 0, Coverage((1, 4), 1, 2, 128, 128, 1024, 127))
    assert r.voucher(SCOPE).covers(1, 64, 4, 1) and not r.voucher(SCOPE).covers(2, 8, 4, 1)


def test_after_reset_a_new_sweep_vouches_again(path):
    """R4.8: a drift and a mismatch block vouching until reset; after it, old vouchers are
    history and a new sweep vouches again."""
    r = HostRecord(path)
    r.add_voucher(SCOPE, "verify", 500, 0, SWEPT)
    r.record_drift(SCOPE, DriftEvent(7, 2, 1, (0, 0), 0.0, 1.0, 1.0, 1, "pid 1"))
    r.add_voucher(SCOPE, "traffic", 1, 1)
    assert not r.voucher(SCOPE).vouches
    r.reset(SCOPE)
    assert r.voucher(SCOPE) == type(r.voucher(SCOPE))(0, 0, False)
    r.add_voucher(SCOPE, "verify", 200, 0, SWEPT)
    assert r.voucher(SCOPE).vouches and r.voucher(SCOPE).comparisons == 200
    assert sqlite3.connect(path).execute("SELECT count(*) FROM vouchers").fetchone()[0] == 3


def test_schema_2_file_migrates_its_old_sweeps_vouch_for_nothing(path):
    """R4.8, R4.9: a record from before coverage was stored keeps working: its drift and golden
    answers stay, and its sweep (which never said what it covered) vouches for nothing."""
    conn = record_at_schema(path, 2)
    conn.execute("INSERT INTO vouchers (fingerprint, revision, backend, source, comparisons, "
                 "mismatches, created_at) VALUES ('f00d', 'rev1', 'onnxruntime', 'verify', 33, "
                 "0, 0)")
    conn.execute("INSERT INTO drift (fingerprint, revision, backend, padded_tokens, "
                 "served_threads, shadow_threads, first_index, served_value, shadow_value, "
                 "created_at) VALUES ('f00d', 'rev1', 'onnxruntime', 7, 2, 1, '[0, 3]', 0.5, "
                 "0.25, 9.0)")
    conn.commit()
    conn.close()
    r = HostRecord(path)
    assert r.quarantined is None
    v = r.voucher(SCOPE)
    assert (v.vouches, v.legacy, v.comparisons) == (False, 1, 33)
    assert r.drift(SCOPE) == DriftEvent(7, 2, 1, (0, 3), 0.5, 0.25, 9.0, 0, "")


# -- shapes verified one by one (the incremental voucher) ----------------------------------

def test_covers_truth_table_sweeps_and_verified_shapes(path):
    """R4.7, R4.8: a forward may serve another count where a sweep covering both counts has
    its shape in bounds, or where that exact shape (rows x padded length) was verified at that
    count against that configured count; nothing else, and nothing after any mismatch."""
    r = HostRecord(path)
    r.add_verified_shapes(SCOPE, 1, [(1, 300, 2), (3, 17, 2), (1, 300, 2), (2, 9, 4)])
    v = r.voucher(SCOPE)
    assert v.vouches and not v.swept  # shapes alone vouch, for themselves
    assert v.covers(1, 300, 2, 1) and v.covers(3, 17, 2, 1) and v.covers(2, 9, 4, 1)
    assert not v.covers(1, 299, 2, 1)  # an unverified shape of the same range
    assert not v.covers(3, 16, 2, 1) and not v.covers(4, 17, 2, 1)  # neighbours: unverified
    assert not v.covers(1, 300, 4, 1)  # a count it was not verified at
    assert not v.covers(1, 300, 2, 4) and not v.covers(1, 300, 1, 2)  # other configured count
    assert v.covers_counts(2, 1) and v.covers_counts(4, 1) and not v.covers_counts(2, 4)
    assert v.shapes_verified(1) == {2: 2, 4: 1} and v.shapes_verified(2) == {}
    rows = sqlite3.connect(path).execute(
        "SELECT comparisons FROM verified_shapes WHERE rows = 1 AND length = 300").fetchall()
    assert rows == [(2,)]  # one row per shape, its comparisons counted
    r.add_voucher(SCOPE, "verify", 500, 0, SWEPT)  # a sweep adds its bounds
    v = r.voucher(SCOPE)
    assert v.covers(4, 64, 2, 1) and v.covers(1, 300, 2, 1) and not v.covers(1, 299, 2, 1)
    r.add_verified_shapes(SCOPE, 1, [], differed=[(5, 5, 2)])  # one shape differed
    v = r.voucher(SCOPE)
    assert (v.vouches, v.shape_mismatches) == (False, 1)
    assert not v.covers(1, 300, 2, 1) and not v.covers(4, 64, 2, 1) \
        and not v.covers_counts(2, 1)  # a mismatch anywhere retires everything
    assert (5, 5, 2, 1) not in v.verified


def test_a_traffic_mismatch_retires_verified_shapes_and_a_reset_forgets_them(path):
    """R4.7: a drift recorded as a traffic mismatch retires shapes verified one by one too;
    after a reset they are forgotten, so only new comparisons vouch again."""
    r = HostRecord(path)
    r.add_verified_shapes(SCOPE, 1, [(1, 8, 2)])
    other = Scope("f00d", "rev1", "onnxruntime", "bfloat16")
    r.add_verified_shapes(other, 1, [(1, 8, 2)])
    r.add_voucher(SCOPE, "traffic", 1, 1)
    assert not r.voucher(SCOPE).covers(1, 8, 2, 1) and r.voucher(other).covers(1, 8, 2, 1)
    r.reset(SCOPE)
    assert r.voucher(SCOPE) == type(r.voucher(SCOPE))(0, 0, False)
    assert r.voucher(other).covers(1, 8, 2, 1)  # another precision's scope is its own
    assert other in r.scopes()
    r.add_verified_shapes(SCOPE, 1, [(1, 8, 2)])
    assert r.voucher(SCOPE).covers(1, 8, 2, 1)


@pytest.mark.parametrize("item", [(0, 8, 2), (1, 8, 1), (1, -3, 2), ("a", 8, 2), (1, 8)])
def test_a_bad_verified_shape_is_refused_naming_it(path, item):
    r = HostRecord(path)
    with pytest.raises(ValueError, match="verified shape"):
        r.add_verified_shapes(SCOPE, 1, [(1, 8, 2), item])
    assert r.voucher(SCOPE).verified == frozenset()  # nothing of the batch was written


def test_schema_4_file_migrates_and_keeps_its_sweeps(path):
    """R4.9: a record of schema 4 gains the verified-shapes table; its sweeps vouch as
    before and it has no shape verified one by one."""
    conn = record_at_schema(path, 4)
    conn.execute("INSERT INTO vouchers (fingerprint, revision, backend, precision, source, "
                 "comparisons, mismatches, created_at, coverage) VALUES "
                 "('f00d', 'rev1', 'onnxruntime', 'float32', 'verify', 500, 0, 0, ?)",
                 [SWEPT.to_json()])
    conn.close()
    r = HostRecord(path)
    assert r.quarantined is None
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    v = r.voucher(SCOPE)
    assert v.vouches and v.coverages == (SWEPT,) and v.verified == frozenset()
    r.add_verified_shapes(SCOPE, 1, [(9, 100, 2)])
    assert r.voucher(SCOPE).covers(9, 100, 2, 1) and r.voucher(SCOPE).covers(1, 8, 2, 1)


@pytest.mark.parametrize("content", [b"this is not sqlite at all" * 100, b""],
                         ids=["garbage", "empty"])
def test_corrupt_file_is_quarantined_and_a_fresh_one_started(path, content):
    path.write_bytes(content)
    r = HostRecord(path)
    r.put_golden(SCOPE, "x")
    if content:
        assert r.quarantined is not None and r.quarantined.read_bytes() == content
    assert r.golden(SCOPE) == "x"


def test_truncated_file_is_quarantined(path):
    r = HostRecord(path)
    for i in range(200):
        r.add_samples(Scope("h", f"rev{i}", "torch"), 8, 1, [float(i)] * 50)
    r.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])  # cut mid-page
    fresh = HostRecord(path)
    assert fresh.quarantined is not None
    assert fresh.timings(Scope("h", "rev1", "torch")) == {}


def test_foreign_sqlite_file_is_quarantined(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE precious (x)")
    conn.execute("INSERT INTO precious VALUES (1)")
    conn.commit()
    conn.close()
    r = HostRecord(path)
    assert r.quarantined is not None
    kept = sqlite3.connect(r.quarantined).execute("SELECT x FROM precious").fetchall()
    assert kept == [(1,)]


def test_newer_schema_is_quarantined(path):
    HostRecord(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    assert HostRecord(path).quarantined is not None


def test_older_schema_is_migrated_keeping_its_data(path):
    conn = record_at_schema(path, 1)
    conn.execute("INSERT INTO golden VALUES ('f00d', 'rev1', 'onnxruntime', 'kept', 0)")
    conn.commit()
    conn.close()
    r = HostRecord(path)
    assert r.quarantined is None and r.golden(SCOPE) == "kept"
    version = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
    assert version == SCHEMA_VERSION


def test_unwritable_location_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(HostRecordError, match="a-file"):
        HostRecord(blocker / "record.sqlite")


def _writers(path, log, n):
    return [subprocess.Popen([sys.executable, "-m", "tests.record_writer", str(path), str(log)])
            for _ in range(n)]


def _committed(log) -> dict[str, int]:
    last: dict[str, int] = defaultdict(lambda: -1)
    for line in log.read_text().splitlines():
        rev, i = line.split()
        last[rev] = max(last[rev], int(i))
    return last


@pytest.mark.parametrize("kills", [int(os.environ.get("VLLM_SRUN_RECORD_KILLS", "6"))])
def test_writers_killed_mid_write_lose_nothing_committed(path, tmp_path, kills):
    """Several processes write at once; each is SIGKILLed mid-write, again and again.
    (Long variant: VLLM_SRUN_RECORD_KILLS=100.)"""
    log = tmp_path / "committed.log"
    log.touch()
    for round_ in range(kills):
        procs = _writers(path, log, 2)
        deadline = time.monotonic() + 20
        start = len(log.read_text().splitlines())
        while len(log.read_text().splitlines()) < start + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGKILL)
            assert p.wait() == -signal.SIGKILL, "a writer failed before it was killed"
        assert len(log.read_text().splitlines()) > start, f"round {round_} wrote nothing"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    r = HostRecord(path)
    for rev, last in _committed(log).items():
        scope = Scope("host", rev, "onnxruntime")
        assert r.learned(scope)[16]["verified_passes"] >= last
        samples = r.timings(scope)[8]
        assert sum(len(s) for s in samples.values()) >= min(last + 1, 256)
