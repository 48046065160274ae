"""What the tuner writes to the host record and reads back (R4.7-R4.9, R4.11): learnings
waiting to be written (``Pending``), every record call guarded so a failing record keeps
learning in memory (``RecordSync.guard``: the report says why), and the thread that reads
drift and the voucher back (``RecordWatch``: a drift any worker of the scope recorded
retires this one within a second). Nothing here runs on the served path."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_srun.records.host_record import DriftEvent, HostRecord, HostRecordError, Scope, Voucher
from vllm_srun.tuner.cadence import waits
from vllm_srun.tuner.siblings import HEARTBEAT_S, new_writer, siblings_learned, starting_counts

log = logging.getLogger(__name__)

# ``RecordWatch.stop`` waits this long for its thread: one record read, a few ms
WATCH_JOIN_S = 10.0


@dataclass
class Pending:
    """Learnings not yet in the record."""

    samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (lo, n) -> ms
    learned: set[int] = field(default_factory=set)  # ranges whose learned count moved on
    comparisons: int = 0  # shadows that agreed with the served answer (traffic's voucher)
    # (rows, padded length, count): batches whose answer at count equalled the configured
    # count's, written as verified shapes (``add_verified_shapes``: the incremental voucher)
    shapes: set[tuple[int, int, int]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.samples or self.learned or self.comparisons or self.shapes)


class RecordSync:
    def __init__(self, record: HostRecord | None, scope: Scope,
                 clock: Callable[[], float]) -> None:
        self.record, self.scope = record, scope
        self.error: str | None = None  # the last record call that failed, in words
        self.pending = Pending()
        self.last_flush = clock()
        # flushes taken (``take``) and written since: a read back that one of them overlapped
        # may lack what it held (``settled``)
        self.taken = self.written = 0
        self._watch: RecordWatch | None = None
        # R4.12: this tuner's id in the record, and when (time.time()) it last said it lives
        self.writer, self.started_at, self.seen_at = new_writer(), time.time(), 0.0

    def guard(self, what: str, fn: Callable[[HostRecord], object]) -> object | None:
        """``fn(record)``, or None without a record or where it fails (kept as ``error``)."""
        if self.record is None:
            return None
        try:
            return fn(self.record)
        except HostRecordError as exc:
            self.error = str(exc)
            log.error("host_record_failed action=%s error=%s", what, exc)
            return None

    def read_back(self) -> tuple[DriftEvent | None, Voucher | None]:
        """The scope's drift and voucher as the record holds them (None for either without a
        record or where the read failed)."""
        scope = self.scope
        return (self.guard("read_drift", lambda rec: rec.drift(scope)),
                self.guard("read_voucher", lambda rec: rec.voucher(scope)))

    def siblings(self, counts: tuple[int, ...], configured: int) -> dict[int, int]:
        """Range -> the count a live other writer of the scope learned there
        (``siblings.starting_counts``); empty without a record."""
        if self.record is None:
            return {}
        return starting_counts(siblings_learned(self.record, self.scope, self.writer),
                               counts, configured)

    def heartbeat(self, period_s: float) -> None:
        """Say this writer lives, where it last did ``min(period_s, HEARTBEAT_S)`` ago."""
        now = time.time()
        if now - self.seen_at >= min(period_s, HEARTBEAT_S):
            self.seen_at = now
            self.guard("heartbeat", lambda rec: rec.note_writer(
                self.scope, self.writer, os.getpid(), self.started_at))

    def gone(self) -> None:
        """This writer stops: no sibling starts from its learned rows any more."""
        self.guard("writer_gone", lambda rec: rec.writer_gone(self.writer))

    def take(self, now: float) -> Pending:
        """What to write now (the caller holds the tuner's lock); nothing pending after."""
        taken, self.pending, self.last_flush = self.pending, Pending(), now
        self.taken += 1
        return taken

    def settled(self) -> int | None:
        """(The tuner's lock held.) The flushes taken so far, where each is written; None
        while one is being written. A read back is this worker's own, up to date with what
        it verified, only where this is the same before the read and after it: else a flush
        took ``pending`` (a shape just verified) from the tuner before the read saw it in the
        record, and taking that read would forget the shape until the next."""
        return self.taken if self.written == self.taken else None

    def write(self, taken: Pending, learned: dict[int, tuple[int, float, int, str | None]],
              configured: int) -> None:
        """Write ``taken`` and ``learned`` (range -> count, speed-up, verified passes, origin)
        under this writer's id, and that it lives; the shapes verified against
        ``configured``."""
        scope, writer = self.scope, self.writer

        def write(record: HostRecord) -> None:
            for (lo, n), ms in taken.samples.items():
                record.add_samples(scope, lo, n, ms)
            if learned:
                record.note_writer(scope, writer, os.getpid(), self.started_at)
                self.seen_at = time.time()
            for lo, (n, up, passes, origin) in learned.items():
                record.put_learned(scope, lo, n, up, passes, writer, origin)
            if taken.comparisons:
                record.add_voucher(scope, "traffic", taken.comparisons, 0)
            if taken.shapes:
                record.add_verified_shapes(scope, configured, taken.shapes)

        self.guard("flush", write)

    def watch(self, poll: Callable[[], None], interval_s: float,
              worker: str | None = None) -> None:
        if self.record is not None and self._watch is None:
            self._watch = RecordWatch(poll, interval_s, worker)

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


class RecordWatch:
    """The tuner's record-reading thread: ``poll`` every ``interval_s`` until stopped. Named
    by its worker, it reads at that worker's own phase and jittered period
    (``cadence.waits``, R4.12): the workers of a host do not read the record, and so do not
    react to what another wrote, in lockstep; every read still comes within
    ``interval_s * (1 + cadence.JITTER)`` of the last."""

    def __init__(self, poll: Callable[[], None], interval_s: float,
                 worker: str | None = None) -> None:
        self._poll = poll
        self._waits = waits(worker, interval_s) if worker is not None else \
            itertools.repeat(interval_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="record-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(next(self._waits)):
            try:
                self._poll()
            except Exception:  # a read that fails is retried at the next interval
                log.exception("record_watch_failed")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=WATCH_JOIN_S)
