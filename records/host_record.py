"""The SQLite host record (R4.9): golden digests, timing samples, learned counts, vouchers,
shapes verified one by one and drift events, keyed by scope = (host fingerprint, artifact
revision, backend, precision).

How it works: one file per host (opened, checked, quarantined or migrated by
:mod:`.record_file`) and one short transaction per write, so several workers can write at
once and a killed writer loses nothing committed. If the record cannot be written at all,
``HostRecordError`` says why and callers keep learning in memory.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import sqlite_utils

from vllm_srun.records.record_file import HostRecordError, open_record
from vllm_srun.records.voucher import Coverage, VerifiedShape, Voucher, shape_item

log = logging.getLogger(__name__)

MAX_SAMPLES = 256  # timing samples kept per (scope, range, count)


@dataclass(frozen=True)
class Scope:
    """What learning is kept per: the host, the artifact's revision, the backend and the
    precision its forwards run in (answers of one differ from another's)."""

    fingerprint: str
    revision: str
    backend: str
    precision: str = "float32"

    def where(self) -> tuple[str, list[str]]:
        return ("fingerprint = ? AND revision = ? AND backend = ? AND precision = ?",
                [self.fingerprint, self.revision, self.backend, self.precision])


@dataclass(frozen=True)
class DriftEvent:
    padded_tokens: int  # rows x padded length
    served_threads: int
    shadow_threads: int
    first_index: tuple[int, ...]  # (row, element) of the first differing element
    served_value: float
    shadow_value: float
    created_at: float = 0.0  # time.time() seconds
    rows: int = 0  # 0: not recorded (a record from before schema 3)
    worker: str = ""  # who saw it: "replica <id> pid <pid>"


class HostRecord:
    """One host's record, shared by its workers. ``quarantined``: where a file found at
    ``path`` that was not a usable record was moved (None: nothing was)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        # scope -> (summary of its verified shapes, what they were then): ``_verified``
        self._shapes_cache: dict[Scope, tuple[tuple, tuple[frozenset[VerifiedShape], int]]] = {}
        self._conn, self.quarantined = open_record(self.path)

    @contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield sqlite_utils.Database(self._conn)
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise HostRecordError(f"cannot write host record {self.path}: {exc}") from exc

    def _rows(self, sql: str, params: list) -> list[dict]:
        with self._lock:
            cur = self._conn.execute(sql, params)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- hosts and golden answers --------------------------------------------------------
    def note_host(self, fingerprint: str, details: dict) -> None:
        with self._write() as db:
            db["hosts"].insert({"fingerprint": fingerprint, "details": json.dumps(details),
                                "first_seen": time.time()}, ignore=True)

    def note_worker(self, scope: Scope, model: str, mode: int, configured: int,
                    counts: list[int]) -> None:
        """The last worker configuration seen for a scope (for offline reports)."""
        with self._write() as db:
            db["workers"].upsert({**_scope(scope), "model": model, "mode": mode,
                                  "configured": configured, "counts": json.dumps(counts),
                                  "updated_at": time.time()},
                                 pk=_KEY)

    def worker(self, scope: Scope) -> dict | None:
        where, params = scope.where()
        rows = self._rows(f"SELECT model, mode, configured, counts FROM workers WHERE {where}",
                          params)
        if not rows:
            return None
        return {**rows[0], "counts": json.loads(rows[0]["counts"])}

    def golden(self, scope: Scope) -> str | None:
        where, params = scope.where()
        rows = self._rows(f"SELECT digest FROM golden WHERE {where}", params)
        return rows[0]["digest"] if rows else None

    def put_golden(self, scope: Scope, digest: str) -> None:
        with self._write() as db:
            db["golden"].insert({**_scope(scope), "digest": digest, "created_at": time.time()},
                                ignore=True)

    # -- timings and learned counts --------------------------------------------------------
    def add_samples(self, scope: Scope, size_lo: int, num_threads: int,
                    samples_ms: list[float]) -> None:
        where, params = scope.where()
        with self._write() as db:
            rows = list(db.query(f"SELECT samples_ms FROM timings WHERE {where} AND size_lo = ? "
                                 "AND num_threads = ?", [*params, size_lo, num_threads]))
            kept = json.loads(rows[0]["samples_ms"]) if rows else []
            kept = (kept + [round(s, 4) for s in samples_ms])[-MAX_SAMPLES:]
            db["timings"].upsert({**_scope(scope), "size_lo": size_lo,
                                  "num_threads": num_threads, "samples_ms": json.dumps(kept),
                                  "updated_at": time.time()},
                                 pk=(*_KEY, "size_lo", "num_threads"))

    def timings(self, scope: Scope) -> dict[int, dict[int, list[float]]]:
        """size_lo -> num_threads -> samples (ms), oldest first."""
        where, params = scope.where()
        out: dict[int, dict[int, list[float]]] = {}
        for row in self._rows(f"SELECT size_lo, num_threads, samples_ms FROM timings "
                              f"WHERE {where}", params):
            out.setdefault(row["size_lo"], {})[row["num_threads"]] = json.loads(
                row["samples_ms"])
        return out

    def forget_range(self, scope: Scope, size_lo: int) -> None:
        """Forget one range's samples and learned count (relearning)."""
        where, params = scope.where()
        with self._write() as db:
            for table in ("timings", "learned"):
                db.execute(f"DELETE FROM {table} WHERE {where} AND size_lo = ?",
                           [*params, size_lo])

    def put_learned(self, scope: Scope, size_lo: int, num_threads: int, speedup: float,
                    verified_passes: int, writer: str = "", origin: str | None = None) -> None:
        """``writer``: the id of the tuner that learned it (each writer keeps its own row per
        range); ``origin``: "own" (its own samples) or "sibling" (a live sibling's count it
        verified)."""
        with self._write() as db:
            db["learned"].upsert({**_scope(scope), "size_lo": size_lo, "writer": writer,
                                  "num_threads": num_threads, "speedup": speedup,
                                  "verified_passes": verified_passes, "updated_at": time.time(),
                                  "origin": origin},
                                 pk=(*_KEY, "size_lo", "writer"))

    def learned(self, scope: Scope) -> dict[int, dict]:
        """size_lo -> the count any worker of the scope last learned for the range (with
        its speed-up, verified passes, when it was written, ``time.time()``, its writer and
        origin)."""
        where, params = scope.where()
        return {r["size_lo"]: r for r in self._rows(
            f"SELECT size_lo, num_threads, speedup, verified_passes, updated_at, writer, origin "
            f"FROM learned WHERE {where} ORDER BY updated_at",
            params)}

    # -- writers (R4.12: whose learned rows a sibling may start from) ----------------------
    def note_writer(self, scope: Scope, writer: str, pid: int, started_at: float) -> None:
        """``writer`` (a tuner of ``scope`` in process ``pid``) is alive now."""
        with self._write() as db:
            db["writers"].upsert({"writer": writer, **_scope(scope), "pid": pid,
                                  "started_at": started_at, "seen_at": time.time()},
                                 pk="writer")

    def writer_gone(self, writer: str) -> None:
        """``writer`` stopped: its learned rows stay as history, no sibling starts from them."""
        with self._write() as db:
            db.execute("DELETE FROM writers WHERE writer = ?", [writer])

    def writers_learned(self, scope: Scope) -> list[dict]:
        """The scope's learned rows whose writer has a writers row, each with that writer's
        ``pid`` and ``seen_at`` (``time.time()``), as stored: the caller validates them."""
        where, params = scope.where()
        return self._rows(
            f"SELECT l.size_lo, l.writer, l.num_threads, l.speedup, l.verified_passes, "
            f"l.updated_at, w.pid, w.seen_at FROM (SELECT * FROM learned WHERE {where}) AS l "
            f"JOIN writers AS w ON w.writer = l.writer ORDER BY l.updated_at", params)

    # -- vouchers and drift ----------------------------------------------------------------
    def add_voucher(self, scope: Scope, source: str, comparisons: int, mismatches: int,
                    coverage: Coverage | None = None) -> None:
        """``source`` "verify" (a sweep, with what it covered) or "traffic" (shadows)."""
        if source == "verify" and coverage is None and comparisons:
            raise ValueError("a sweep's voucher must say what it covered")
        with self._write() as db:
            db["vouchers"].insert({**_scope(scope), "source": source,
                                   "comparisons": comparisons, "mismatches": mismatches,
                                   "coverage": coverage.to_json() if coverage else None,
                                   "created_at": time.time()})

    def voucher(self, scope: Scope) -> Voucher:
        """The vouchers recorded since the scope's last reset, taken together."""
        where, params = scope.where()
        rows = self._rows(f"SELECT source, comparisons, mismatches, coverage FROM vouchers "
                          f"WHERE {where} AND reset_at IS NULL ORDER BY id", params)
        sweeps = [r for r in rows if r["source"] == "verify" and r["comparisons"] > 0]
        coverages = []
        for r in sweeps:
            if r["coverage"]:
                try:
                    coverages.append(Coverage.from_json(r["coverage"]))
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning("voucher_coverage_unreadable scope=%s error=%s", scope, exc)
        verified, shape_mismatches = self._verified(scope)
        return Voucher(comparisons=sum(r["comparisons"] for r in rows),
                       mismatches=sum(r["mismatches"] for r in rows),
                       swept=bool(coverages), coverages=tuple(coverages),
                       legacy=sum(not r["coverage"] for r in sweeps),
                       verified=verified, shape_mismatches=shape_mismatches)

    def _verified(self, scope: Scope) -> tuple[frozenset[VerifiedShape], int]:
        """The scope's shapes verified one by one, and those that differed. Read again only
        when a summary of the table changed (workers read the voucher twice a second, and
        12,000 shapes took 70 ms to read here, a 1-ms summary)."""
        where, params = scope.where()
        (summary,) = self._rows(f"SELECT count(*) AS n, total(comparisons) AS c, "
                                f"max(updated_at) AS at FROM verified_shapes WHERE {where}",
                                params)
        key = tuple(summary.values())
        cached = self._shapes_cache.get(scope)
        if cached is not None and cached[0] == key:
            return cached[1]
        with self._lock:
            rows = self._conn.execute(f"SELECT rows, length, num_threads, configured, "
                                      f"comparisons, mismatches FROM verified_shapes "
                                      f"WHERE {where}", params).fetchall()
        found = (frozenset((r, n, k, c) for r, n, k, c, compared, bad in rows
                           if compared > 0 and not bad), sum(row[5] for row in rows))
        self._shapes_cache[scope] = (key, found)
        return found

    def add_verified_shapes(self, scope: Scope, configured: int,
                            equal: Iterable[tuple[int, int, int]],
                            differed: Iterable[tuple[int, int, int]] = (),
                            source: str = "traffic") -> None:
        """Shapes compared one by one, in one transaction: (rows, padded length, count) whose
        answer at ``count`` was bit-identical to the configured count's on one batch of that
        exact shape (``equal``), or was not (``differed``: nothing vouches after it).
        ``source`` "traffic" (shadows of served batches) or "verify" (a bounded sweep)."""
        bad = Counter(shape_item(item, configured) for item in differed)
        tally = Counter(shape_item(item, configured) for item in equal) + bad  # comparisons
        if not tally:
            return
        now, key = time.time(), list(asdict(scope).values())
        with self._write() as db:
            db.conn.executemany(
                "INSERT INTO verified_shapes (fingerprint, revision, backend, precision, "
                "configured, rows, length, num_threads, comparisons, mismatches, source, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (fingerprint, revision, backend, precision, configured, rows, "
                "length, num_threads) DO UPDATE SET "
                "comparisons = comparisons + excluded.comparisons, "
                "mismatches = mismatches + excluded.mismatches, updated_at = excluded.updated_at",
                [(*key, configured, *shape, c, bad[shape], source, now)
                 for shape, c in tally.items()])

    def record_drift(self, scope: Scope, event: DriftEvent) -> None:
        with self._write() as db:
            db["drift"].insert({**_scope(scope), "padded_tokens": event.padded_tokens,
                                "served_threads": event.served_threads,
                                "shadow_threads": event.shadow_threads,
                                "first_index": json.dumps(list(event.first_index)),
                                "served_value": event.served_value,
                                "shadow_value": event.shadow_value,
                                "created_at": event.created_at or time.time(),
                                "rows": event.rows or None, "worker": event.worker or None})

    def drift(self, scope: Scope) -> DriftEvent | None:
        """The drift event that retired learning for this scope, unless reset."""
        where, params = scope.where()
        rows = self._rows(f"SELECT * FROM drift WHERE {where} AND reset_at IS NULL "
                          "ORDER BY id LIMIT 1", params)
        if not rows:
            return None
        r = rows[0]
        return DriftEvent(r["padded_tokens"], r["served_threads"], r["shadow_threads"],
                          tuple(json.loads(r["first_index"])), r["served_value"],
                          r["shadow_value"], r["created_at"], r["rows"] or 0,
                          r["worker"] or "")

    def reset(self, scope: Scope) -> None:
        """Operator reset: forget drift, learned counts, timings and verified shapes for the
        scope, and retire its vouchers (kept as history): mode 2 serves a learned count again
        only where a new sweep or new comparisons vouch."""
        where, params = scope.where()
        now = time.time()
        with self._write() as db:
            for table in ("drift", "vouchers"):
                db.execute(f"UPDATE {table} SET reset_at = ? WHERE {where} AND reset_at IS NULL",
                           [now, *params])
            for table in ("learned", "timings", "verified_shapes"):
                db.execute(f"DELETE FROM {table} WHERE {where}", params)

    def scopes(self) -> list[Scope]:
        rows = self._rows(" UNION ".join(f"SELECT {', '.join(_KEY)} FROM {table}" for table in
                                         ("workers", "golden", "timings", "vouchers",
                                          "verified_shapes")), [])
        return [Scope(**r) for r in rows]


_KEY = ("fingerprint", "revision", "backend", "precision")


def _scope(scope: Scope) -> dict:
    return asdict(scope)


def default_record_path(data_dir: Path) -> Path:
    return Path(os.environ.get("VLLM_SRUN_RECORD") or data_dir / "host-record.sqlite")
