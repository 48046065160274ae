"""Opening the host record's SQLite file (R4.9): connect, check it is ours, migrate it.

How it works: WAL mode and a busy timeout, so several workers can write at once and a killed
writer loses nothing committed. The file is ours when its ``application_id`` says so; its
``user_version`` is the schema version, migrated forward in order, one transaction a step. A
file that is not SQLite, belongs to someone else or comes from a newer schema is moved aside
(quarantined) with a warning and a fresh one is started: opening a record never crashes a
worker. A lock held by another worker is no damage: it is waited out, never moved aside. If
the file cannot be opened or written at all, ``HostRecordError`` says why.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from vllm_srun.records.schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)

OPEN_ATTEMPTS = 50  # 0.1 s apart: another worker may hold the lock while setting up


class HostRecordError(Exception):
    """The record cannot be opened or written (the message says where and why)."""


def open_record(path: Path) -> tuple[sqlite3.Connection, Path | None]:
    """A connection to the record at ``path``, at the newest schema, and where a file found
    there that was not a usable record was moved (None: nothing was moved)."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return _open_once(path)
        except sqlite3.OperationalError as exc:
            if not busy(exc) or attempt == OPEN_ATTEMPTS - 1:
                raise HostRecordError(f"cannot open host record {path}: {exc}") from exc
            time.sleep(0.1)
    raise AssertionError("unreachable")


def busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is another connection's lock (wait, retry), not damage."""
    return isinstance(exc, sqlite3.OperationalError) and (
        "locked" in str(exc) or "busy" in str(exc))


def _connect(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    except (OSError, sqlite3.Error) as exc:
        raise HostRecordError(f"cannot open host record {path}: {exc}") from exc
    return conn


def _open_once(path: Path) -> tuple[sqlite3.Connection, Path | None]:
    conn = _connect(path)
    try:
        problem = _check(conn)
    except sqlite3.DatabaseError as exc:
        if busy(exc):  # a lock held by another worker is no damage: retry, never move
            conn.close()
            raise
        problem = f"not a readable SQLite file ({exc})"
    if problem is None:
        try:
            _migrate(conn)
            return conn, None
        except sqlite3.OperationalError as exc:
            conn.close()
            if busy(exc):
                raise
            raise HostRecordError(f"cannot write host record {path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            problem = f"damaged ({exc})"
    conn.close()
    moved_to = _quarantine(path, problem)
    conn = _connect(path)
    try:
        _migrate(conn)
    except sqlite3.Error as exc:
        conn.close()
        raise HostRecordError(f"cannot write host record {path}: {exc}") from exc
    return conn, moved_to


def _check(conn: sqlite3.Connection) -> str | None:
    """None if the file is ours (or new); else why it must be moved aside. The header and
    the tables are read by one statement, so from one snapshot: read apart, a worker
    that created the tables between the reads made a new record look foreign
    (application_id 0 with tables), and it was moved aside under the worker writing to
    it (a kill test lost a writer's committed learnings so, under the full suite's
    load)."""
    app_id, version, tables = conn.execute(
        "SELECT (SELECT application_id FROM pragma_application_id),"
        " (SELECT user_version FROM pragma_user_version),"
        " (SELECT count(*) FROM sqlite_master)").fetchone()
    if app_id == 0 and tables == 0:
        return None  # new or empty file
    if app_id != APPLICATION_ID:
        return f"not a vllm-srun host record (application_id {app_id:#x})"
    if version > SCHEMA_VERSION:
        return f"schema version {version} is newer than this program's {SCHEMA_VERSION}"
    if conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
        return "failed SQLite's integrity check"
    return None


def _quarantine(path: Path, problem: str) -> Path:
    """Move the file (and its WAL and shared-memory files) aside; where it went."""
    target = path.with_name(f"{path.name}.quarantined-{int(time.time())}")
    for suffix in ("-wal", "-shm"):
        side = Path(str(path) + suffix)
        if side.exists():
            side.replace(Path(str(target) + suffix))
    try:
        path.replace(target)
    except OSError as exc:
        raise HostRecordError(
            f"host record {path} is {problem}, and cannot be moved aside: {exc}") from exc
    log.warning("host_record_quarantined path=%s moved_to=%s reason=%s", path, target, problem)
    return target


def _migrate(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    for number in range(version + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            if current < number:  # another worker may have migrated meanwhile
                for statement in MIGRATIONS[number - 1]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
