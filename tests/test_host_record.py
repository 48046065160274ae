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

from vllm_srun.records.host_record import (
    APPLICATION_ID,
    MIGRATIONS,
    SCHEMA_VERSION,
    DriftEvent,
    HostRecord,
    HostRecordError,
    Scope,
)

SCOPE = Scope("f00d", "rev1", "onnxruntime")


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
    r.add_voucher(SCOPE, "verify", 10, 0)
    r.close()
    r = HostRecord(path)
    assert r.golden(SCOPE) == "abc"
    assert r.timings(SCOPE) == {8: {1: [1.0, 2.0, 3.0]}}
    assert r.learned(SCOPE)[8]["num_threads"] == 2
    assert r.voucher(SCOPE).vouches
    assert r.golden(Scope("other", "rev1", "onnxruntime")) is None


def test_drift_retires_until_reset_and_reset_keeps_history(path):
    r = HostRecord(path)
    r.add_samples(SCOPE, 8, 1, [1.0])
    event = DriftEvent(7, 2, 1, (0, 17), 0.25, 0.2500001, 123.0)
    r.record_drift(SCOPE, event)
    assert HostRecord(path).drift(SCOPE) == event
    r.reset(SCOPE)
    assert r.drift(SCOPE) is None and r.timings(SCOPE) == {}
    rows = sqlite3.connect(path).execute("SELECT count(*) FROM drift").fetchone()[0]
    assert rows == 1


def test_traffic_comparisons_alone_do_not_vouch(path):
    r = HostRecord(path)
    r.add_voucher(SCOPE, "traffic", 500, 0)
    assert not r.voucher(SCOPE).vouches
    r.add_voucher(SCOPE, "verify", 40, 0)
    assert r.voucher(SCOPE).vouches and r.voucher(SCOPE).comparisons == 540
    r.add_voucher(SCOPE, "traffic", 1, 1)
    assert not r.voucher(SCOPE).vouches


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
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 1")
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
