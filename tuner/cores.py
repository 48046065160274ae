"""Cores shared among the workers of one host (R4.12): a ledger of the intra-op threads each
worker's running forward uses, and the pure rule that grants a count above the configured one.

How it works: a small file next to the host record (``cores_path``), mapped by every worker
that opens it, holds one slot per worker: its pid, the threads of its served forward, since
when, until when they count (while it runs, and ``LINGER_S`` after it ended: under load the
worker's next forward is about to start), and its configured count. A count above the
configured one is served only when ``grant`` allows it: the other workers' threads plus the
wanted count stay within the budget. That check and the slot's write happen under an
exclusive lock on the file's first byte (``fcntl`` open-file-description locks), tried
``LOCK_TRIES`` times without waiting: a worker that finds another one checking all along
serves its configured count this once. Serving the configured count or fewer needs no check
(the answer is exact there, and the operator chose that count), and ending a forward only
lowers what the slot counts for, so both write the slot without the lock, each field one
aligned 8-byte store: a reader sees the old value or the new one, and either keeps the
budget. On the served path a claim reads no file and makes no syscall at the configured
count, and two ``fcntl`` calls above it.

Each worker holds a lock on its slot's byte (bytes 1..``SLOTS``) for as long as it has the
ledger open; the kernel drops it when the process ends, however it ends. A worker refused a
grant tries, at most once every ``REAP_S``, each other occupied slot's lock: one it gets
belongs to a dead worker, whose slot is cleared, so a worker killed mid-forward holds its
threads until a worker is next refused a count with its look for dead slots due.

Invariant: a count above a worker's configured one is granted only while the threads in all
slots, that count included, stay within the budget. The sum may pass the budget only through
configured counts (never refused; where they alone exceed the budget the operator chose so)
started after a grant was checked, and then only until that granted forward ends.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from vllm_srun.runtime.types import ForwardResult, TokenBatch

log = logging.getLogger(__name__)

MAGIC = b"VSRUNCOR"
VERSION = 1
SLOTS = 128  # workers one ledger holds; a worker past them runs without the ledger
FIELDS = 5  # pid, threads, since and until (time.monotonic_ns), configured count
RUNNING = np.iinfo(np.int64).max  # ``until`` of a forward still running
HEADER_BYTES = 64
SLOT_BYTES = FIELDS * 8
SIZE_BYTES = HEADER_BYTES + SLOTS * SLOT_BYTES
# How often a refused worker looks for dead workers' slots: each look tries one lock per
# occupied slot (a syscall each); once a second keeps that off nearly every forward while a
# dead worker's threads are counted for about a second at most after the next refusal.
REAP_S = 1.0
# How long a worker's threads count for the others after its forward ended: under load a
# worker that ended a forward this recently is about to start the next one (it delivers the
# answers and picks the next batch meanwhile), and a grant made in that gap would pass the
# budget once it does, for the whole granted forward. A guess, not measured: a few times
# what picking and delivering a batch should take.
LINGER_S = 0.005
# Tries at the file lock before a claim gives up and serves the configured count: another
# worker holds it for one check (about 5 us here), so a second try usually finds it free;
# three tries cost at most a few microseconds and never wait on a worker descheduled while
# holding it. A guess, not swept.
LOCK_TRIES = 3

# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0: an OFD lock)
_FLOCK = "hhqqi4x"
_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
_SETLKW = getattr(fcntl, "F_OFD_SETLKW", fcntl.F_SETLKW)


class CoreShareError(Exception):
    """The ledger cannot be opened (the message names the file and why); the worker serves
    without it."""


# -- policy ------------------------------------------------------------------------------

def grant(want: int, floor: int, in_use_by_others: int, budget: int) -> int:
    """The count a worker may serve: ``want`` when it is at most the configured count
    (``floor``) or when the other workers' threads plus ``want`` stay within ``budget``;
    else ``floor``, which is exact at every vouched count and always allowed."""
    if want <= floor or in_use_by_others + want <= budget:
        return want
    return floor


def cores_path(record_path: Path | str) -> Path:
    """Where the ledger of the workers sharing ``record_path``'s host lives: beside it."""
    path = Path(record_path)
    return path.with_name(f"{path.name}.cores-v{VERSION}")


@dataclass(frozen=True)
class Slot:
    """One worker's slot as read now."""

    pid: int
    threads: int  # threads it counts for now (running, or ended under ``LINGER_S`` ago)
    since_s: float  # time.monotonic() when it claimed them, or ended its last forward
    configured: int


# -- mechanism ---------------------------------------------------------------------------

def _flock(kind: int, start: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, 1, 0)


# the file lock on byte 0, packed once: a claim above the configured count takes and drops it
_TAKE, _DROP = _flock(fcntl.F_WRLCK, 0), _flock(fcntl.F_UNLCK, 0)


def _try(fd: int, packed: bytes, wait: bool = False) -> bool:
    """Apply one lock request; False when another open file holds the byte."""
    try:
        fcntl.fcntl(fd, _SETLKW if wait else _SETLK, packed)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _slot_lock(index: int, kind: int) -> bytes:
    return _flock(kind, 1 + index)  # bytes 1..SLOTS: held by each slot's owner while alive


class CoreShare:
    """This worker's view of the ledger: ``claim`` before a served forward, ``release``
    after it, ``close`` at the end. One served forward at a time per worker (the engine
    runs one loop)."""

    def __init__(self, path: Path, fd: int, mapped: mmap.mmap, budget: int, worker: str,
                 linger_s: float = LINGER_S, reap_s: float = REAP_S) -> None:
        self.path, self.budget, self.worker = path, budget, worker
        self.linger_s, self.reap_s = linger_s, reap_s
        self._fd, self._mapped = fd, mapped
        columns = np.frombuffer(mapped, dtype=np.int64, count=FIELDS * SLOTS,
                                offset=HEADER_BYTES).reshape(FIELDS, SLOTS)
        self._pid, self._threads, self._since, self._until, self._floor = columns
        self._index = -1
        self._linger_ns = int(linger_s * 1e9)
        self._reaped_at = time.monotonic()
        self.refused = 0  # claims above the configured count the budget refused
        self.contended = 0  # claims above it served at it: another worker held the lock
        self.lock_error = ""  # why the lock failed other than by being held, if it did
        self.reaped = 0  # dead workers' slots cleared

    @classmethod
    def open(cls, path: Path | str, budget: int, worker: str, linger_s: float = LINGER_S,
             reap_s: float = REAP_S) -> CoreShare:
        """Open (creating it if new) the ledger at ``path`` and take a slot for this process.
        ``budget``: the CPUs the host's workers share; ``worker``: who, for logs; the
        constants' docs say what ``linger_s`` and ``reap_s`` are."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise CoreShareError(f"budget must be a positive integer, got {budget!r}")
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CoreShareError(f"cannot open core ledger {path}: {exc}") from exc
        try:
            _try(fd, _TAKE, wait=True)  # opening may wait: it is not on a served path
            try:
                share = cls(path, fd, _map(path, fd), budget, worker, linger_s, reap_s)
                share._take_slot()
            finally:
                _try(fd, _DROP)
        except BaseException:
            os.close(fd)
            raise
        log.info("core_share_opened path=%s worker=%s budget=%d slot=%d", path, worker,
                 budget, share._index)
        return share

    def _take_slot(self) -> None:
        """A free slot, or a dead worker's (under the file lock)."""
        for index in range(SLOTS):
            if _try(self._fd, _slot_lock(index, fcntl.F_WRLCK)):
                if self._pid[index]:
                    self._clear(index)
                self._index = index
                self._threads[index] = self._until[index] = self._floor[index] = 0
                self._since[index] = time.monotonic_ns()
                self._pid[index] = os.getpid()
                return
        raise CoreShareError(f"core ledger {self.path} is full: {SLOTS} workers hold it")

    def claim(self, want: int, floor: int) -> int:
        """The count this worker may serve now (``grant``), held in its slot until
        ``release``. Never waits: a count above ``floor`` refused, or met while another
        worker checks, is ``floor``."""
        index = self._index
        if want <= floor:
            granted = want
        elif not self._take():
            self.contended += 1
            granted = floor
        else:
            try:
                granted = grant(want, floor, self._others(), self.budget)
                if granted != want and self._reap_due():
                    granted = grant(want, floor, self._others(), self.budget)
                self._threads[index] = granted  # under the lock: the next check counts it
                self._until[index] = RUNNING
            finally:
                _try(self._fd, _DROP)
            self.refused += granted != want
        self._threads[index] = granted
        self._until[index] = RUNNING
        self._since[index] = time.monotonic_ns()
        self._floor[index] = floor
        return granted

    def _take(self) -> bool:
        """The file lock, in ``LOCK_TRIES`` tries; False if another worker held it all
        along, or if the lock failed otherwise (logged once: the served path goes on)."""
        try:
            return any(_try(self._fd, _TAKE) for _ in range(LOCK_TRIES))
        except OSError as exc:
            if not self.lock_error:
                log.error("core_share_lock_failed path=%s error=%s", self.path, exc)
            self.lock_error = str(exc)
            return False

    def release(self) -> None:
        """The served forward ended: its threads count for others ``linger_s`` more."""
        now = time.monotonic_ns()
        self._until[self._index] = now + self._linger_ns
        self._since[self._index] = now

    def in_use(self) -> int:
        """Threads all workers' slots count for now: running forwards, and forwards ended
        less than their ``linger_s`` ago (this worker's included). Read without the file
        lock, slot by slot: a slot that changed during the read may count twice."""
        return int(self._threads[self._until > time.monotonic_ns()].sum())

    def in_use_locked(self) -> int:
        """``in_use`` read under the file lock (waiting for it), where no slot can rise:
        the sum as it stood at one moment, or above it only by slots that have fallen."""
        _try(self._fd, _TAKE, wait=True)
        try:
            return self.in_use()
        finally:
            _try(self._fd, _DROP)

    def _others(self) -> int:
        """``in_use`` less this worker's own (under the file lock)."""
        self._until[self._index] = 0  # rewritten by the caller
        return self.in_use()

    def _reap_due(self) -> bool:
        """Clear dead workers' slots, at most once every ``reap_s`` (under the file lock);
        True if any was cleared."""
        now = time.monotonic()
        if now - self._reaped_at < self.reap_s:
            return False
        self._reaped_at = now
        found = 0
        for index in np.flatnonzero(self._pid):
            if index != self._index and _try(self._fd, _slot_lock(index, fcntl.F_WRLCK)):
                self._clear(index)
                _try(self._fd, _slot_lock(index, fcntl.F_UNLCK))
                found += 1
        return found > 0

    def _clear(self, index: int) -> None:
        """A dead worker's slot (its lock is ours now): what it held no longer counts."""
        log.info("core_share_reaped path=%s pid=%d threads=%d", self.path, self._pid[index],
                 self._threads[index])
        self.reaped += 1
        self._threads[index] = self._until[index] = self._since[index] = 0
        self._floor[index] = self._pid[index] = 0

    def slots(self) -> list[Slot]:
        """Every occupied slot as read now (reports and tests)."""
        now_ns, now_s = time.monotonic_ns(), time.monotonic()
        rows = zip(self._pid.copy(), self._threads.copy(), self._since.copy(),
                   self._until.copy(), self._floor.copy(), strict=True)
        return [Slot(int(pid), int(n) if until > now_ns else 0,
                     now_s - (now_ns - int(since)) / 1e9, int(floor))
                for pid, n, since, until, floor in rows if pid]

    def close(self) -> None:
        """Leave the ledger: the slot is cleared and freed."""
        if self._fd < 0:
            return
        index = self._index
        self._threads[index] = self._until[index] = self._floor[index] = 0
        self._pid[index] = 0
        _try(self._fd, _slot_lock(index, fcntl.F_UNLCK))
        del self._pid, self._threads, self._since, self._until, self._floor  # (views)
        self._mapped.close()
        os.close(self._fd)
        self._fd = -1


def _map(path: Path, fd: int) -> mmap.mmap:
    """The ledger mapped, written fresh when empty (under the file lock: by one worker)."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            os.ftruncate(fd, SIZE_BYTES)
            os.pwrite(fd, struct.pack("<8sqq", MAGIC, VERSION, SLOTS), 0)
            size = SIZE_BYTES
        header = os.pread(fd, 24, 0)
    except OSError as exc:
        raise CoreShareError(f"cannot set up core ledger {path}: {exc}") from exc
    magic, version, slots = struct.unpack("<8sqq", header.ljust(24, b"\0"))
    if (magic, version, slots, size) != (MAGIC, VERSION, SLOTS, SIZE_BYTES):
        raise CoreShareError(f"{path} is not a core ledger of version {VERSION} "
                             f"({size} bytes, header {magic!r} {version} {slots}); "
                             "remove it to start a fresh one")
    return mmap.mmap(fd, SIZE_BYTES)


class ThreadsPolicy(Protocol):  # runtime.engine.ThreadsPolicy, restated to stay a seam
    def served_threads(self, batch: TokenBatch) -> int: ...

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None: ...

    def close(self) -> None: ...


class SharedCores:
    """A worker's threads policy with its served counts held in the host's ledger: a count
    above the configured one that the ledger does not grant serves the configured count."""

    def __init__(self, policy: ThreadsPolicy, share: CoreShare, configured: int) -> None:
        self.policy, self.share, self.configured = policy, share, configured
        self.limited = 0  # forwards served at the configured count instead of a higher one

    def served_threads(self, batch: TokenBatch) -> int:
        want = self.policy.served_threads(batch)
        granted = self.share.claim(want, self.configured)
        self.limited += granted != want
        return granted

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None:
        self.share.release()
        self.policy.observe(batch, result)

    def close(self) -> None:
        try:
            self.policy.close()
        finally:
            self.share.close()
