"""Cores shared among the workers of one host (R4.12): a ledger of the intra-op threads each
worker's running forward uses, claimed by the rules of ``core_rules.py`` (``grant`` a count
within the ``room`` other tasks leave the workers).

How it works: a small file next to the host record (``cores_path``; its layout and locks:
``core_ledger.py``), mapped by every worker that opens it, holds one slot per worker: its
pid, the threads of its served forward, since when, until when they count (while it runs,
and ``LINGER_S`` after it ended: under load the worker's next forward is about to start),
and its configured count. The room is the budget less the cores other tasks hold (a
neighbour, the front end: ``FreeCpus.held``, read off the served path). A count serves
where the other workers' threads, a fair share of the room for each idle one, and it fit
the room; else the largest count below it that fits and answers the same (the configured
count; in mode 2 the vouched counts for the shape), else the smallest of those. Each
worker's own forward time cannot see this: a worker that takes more threads takes a larger
share of oversubscribed cores, so each worker alone learns more threads than the host can
give all of them (simulated, 64 cores, 8 workers, a neighbour on up to half: the workers'
served threads passed the cores 1.6-2.8% of the time, and all forwards ran slower).

The check and the slot's write happen under an exclusive lock on the file, tried
``LOCK_TRIES`` times without waiting: a worker that finds another one checking all along
serves at most its configured count this once. A count with nothing below it to serve
instead needs no check, and ending a forward only lowers what the slot counts for, so both
write the slot without the lock, each field one aligned 8-byte store: a reader sees the old
value or the new one. On the served path a claim makes no syscall where nothing could be
served instead, and two ``fcntl`` calls otherwise.

Each worker holds a lock on its slot for as long as it has the ledger open; the kernel drops
it when the process ends, however it ends. A worker refused a grant tries, at most once
every ``REAP_S``, each other occupied slot's lock: one it gets belongs to a dead worker,
whose slot is cleared, so a worker killed mid-forward holds its threads until a worker is
next refused a count with its look for dead slots due.

Invariant: a count is granted over the room only where nothing below it may serve (the
configured count without lower vouched ones; the smallest allowed count). The sum may pass
the room otherwise only through such counts started after a grant was checked, until that
granted forward ends, or where other tasks took cores since the last reading.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_srun.tuner.core_ledger import (
    RUNNING,
    SLOTS,
    VERSION,
    CoreShareError,
    LedgerFile,
    lock_file,
    open_fd,
    unlock_file,
)
from vllm_srun.tuner.core_rules import fair_share, grant, room

log = logging.getLogger(__name__)

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


@dataclass
class ClaimTally:
    """What this worker's claims and looks for dead slots went through (reports, tests)."""

    refused: int = 0  # claims above the configured count the budget refused
    contended: int = 0  # claims above it served at it: another worker held the lock
    lock_error: str = ""  # why the lock failed other than by being held, if it did
    reaped: int = 0  # dead workers' slots cleared


# -- mechanism ---------------------------------------------------------------------------

class CoreShare:
    """This worker's view of the ledger: ``claim`` before a served forward, ``release``
    after it, ``close`` at the end. One served forward at a time per worker (the engine
    runs one loop)."""

    def __init__(self, ledger: LedgerFile, budget: int, worker: str,
                 linger_s: float = LINGER_S, reap_s: float = REAP_S,
                 held: Callable[[], float | None] | None = None) -> None:
        self.ledger, self.budget, self.worker = ledger, budget, worker
        self.held = held
        self.linger_s, self.reap_s = linger_s, reap_s
        self._index = -1
        self._linger_ns = int(linger_s * 1e9)
        self._reaped_at = time.monotonic()
        self.tally = ClaimTally()
        self._closing = threading.Lock()

    @classmethod
    def open(cls, path: Path | str, budget: int, worker: str, linger_s: float = LINGER_S,
             reap_s: float = REAP_S,
             held: Callable[[], float | None] | None = None) -> CoreShare:
        """Open (creating it if new) the ledger at ``path`` and take a slot for this process.
        ``budget``: the CPUs the host's workers share; ``worker``: who, for logs; ``held``:
        the cores other tasks hold now (``FreeCpus.held``; None: unknown), which the budget
        leaves them (``room``); the constants' docs say what ``linger_s`` and ``reap_s``
        are."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise CoreShareError(f"budget must be a positive integer, got {budget!r}")
        path = Path(path)
        fd = open_fd(path)
        try:
            lock_file(fd, wait=True)  # opening may wait: it is not on a served path
            try:
                share = cls(LedgerFile(path, fd), budget, worker, linger_s, reap_s, held)
                share._take_slot()
            finally:
                unlock_file(fd)
        except BaseException:
            os.close(fd)
            raise
        log.info("core_share_opened path=%s worker=%s budget=%d slot=%d", path, worker,
                 budget, share._index)
        return share

    def _take_slot(self) -> None:
        """A free slot, or a dead worker's (under the file lock)."""
        led = self.ledger
        for index in range(SLOTS):
            if led.take_slot(index):
                if led.pid[index]:
                    self._clear(index)
                self._index = index
                led.threads[index] = led.until[index] = led.floor[index] = 0
                led.since[index] = time.monotonic_ns()
                led.pid[index] = os.getpid()
                return
        raise CoreShareError(f"core ledger {self.ledger.path} is full: {SLOTS} workers hold it")

    def claim(self, want: int, floor: int, lower: Sequence[int] = ()) -> int:
        """The count this worker may serve now (``grant``, within ``room``), held in its slot
        until ``release``. Never waits: met while another worker checks, a count above
        ``floor`` serves ``floor``, one at most ``floor`` serves as asked."""
        index, led = self._index, self.ledger
        if want <= floor and not any(n < want for n in lower):
            granted = want
        elif not self._take():
            self.tally.contended += 1
            granted = min(want, floor)
        else:
            try:
                budget = self.room_now()
                granted = self._grant(want, floor, budget, lower)
                if granted != want and self._reap_due():
                    granted = self._grant(want, floor, budget, lower)
                led.threads[index] = granted  # under the lock: the next check counts it
                led.until[index] = RUNNING
            finally:
                led.drop()
            self.tally.refused += granted != want
        led.threads[index] = granted
        led.until[index] = RUNNING
        led.since[index] = time.monotonic_ns()
        led.floor[index] = floor
        return granted

    def room_now(self) -> int:
        """The threads the workers may serve together now (``room``: the budget less the
        cores other tasks hold)."""
        return room(self.budget, self.held() if self.held is not None else None)

    def _take(self) -> bool:
        """The file lock, in ``LOCK_TRIES`` tries; False if another worker held it all
        along, or if the lock failed otherwise (logged once: the served path goes on)."""
        try:
            return any(self.ledger.take() for _ in range(LOCK_TRIES))
        except OSError as exc:
            if not self.tally.lock_error:
                log.error("core_share_lock_failed path=%s error=%s", self.ledger.path, exc)
            self.tally.lock_error = str(exc)
            return False

    def release(self) -> None:
        """The served forward ended: its threads count for others ``linger_s`` more."""
        now = time.monotonic_ns()
        self.ledger.until[self._index] = now + self._linger_ns
        self.ledger.since[self._index] = now

    def in_use(self) -> int:
        """Threads all workers' slots count for now: running forwards, and forwards ended
        less than their ``linger_s`` ago (this worker's included). Read without the file
        lock, slot by slot: a slot that changed during the read may count twice."""
        led = self.ledger
        return int(led.threads[led.until > time.monotonic_ns()].sum())

    def in_use_locked(self) -> int:
        """``in_use`` read under the file lock (waiting for it), where no slot can rise:
        the sum as it stood at one moment, or above it only by slots that have fallen."""
        self.ledger.take(wait=True)
        try:
            return self.in_use()
        finally:
            self.ledger.drop()

    def _grant(self, want: int, floor: int, budget: int, lower: Sequence[int]) -> int:
        """``grant`` as the slots stand (under the file lock): the other workers' threads
        (``in_use`` less this worker's own), how many other workers hold a slot but no
        threads now, each keeping its ``fair_share`` of ``budget`` among the live workers."""
        led = self.ledger
        led.until[self._index] = 0  # rewritten by the caller
        counting = led.until > time.monotonic_ns()
        idle = int(np.count_nonzero(led.pid[~counting])) - 1
        live = int(np.count_nonzero(led.pid))
        return grant(want, floor, int(led.threads[counting].sum()), idle, budget, lower,
                     fair_share(budget, live))

    def _reap_due(self) -> bool:
        """Clear dead workers' slots, at most once every ``reap_s`` (under the file lock);
        True if any was cleared."""
        now = time.monotonic()
        if now - self._reaped_at < self.reap_s:
            return False
        self._reaped_at = now
        found, led = 0, self.ledger
        for index in np.flatnonzero(led.pid):
            if index != self._index and led.take_slot(index):
                self._clear(index)
                led.free_slot(index)
                found += 1
        return found > 0

    def _clear(self, index: int) -> None:
        """A dead worker's slot (its lock is ours now): what it held no longer counts."""
        led = self.ledger
        log.info("core_share_reaped path=%s pid=%d threads=%d", self.ledger.path, led.pid[index],
                 led.threads[index])
        self.tally.reaped += 1
        led.clear(index)

    def slots(self) -> list[Slot]:
        """Every occupied slot as read now (reports and tests)."""
        now_ns, now_s, led = time.monotonic_ns(), time.monotonic(), self.ledger
        rows = zip(led.pid.copy(), led.threads.copy(), led.since.copy(), led.until.copy(),
                   led.floor.copy(), strict=True)
        return [Slot(int(pid), int(n) if until > now_ns else 0,
                     now_s - (now_ns - int(since)) / 1e9, int(floor))
                for pid, n, since, until, floor in rows if pid]

    def sibling_pids(self) -> tuple[int, ...]:
        """The pids of the other workers holding slots (read without the file lock: a slot that
        changes meanwhile is read either way); ``FreeCpus`` gives this worker its share of
        the cores beside them."""
        with self._closing:  # another thread reads: the mapping must outlive the copy
            if self.ledger.fd < 0:
                return ()
            pids = self.ledger.pid.copy()
        return tuple(int(p) for i, p in enumerate(pids) if p > 0 and i != self._index)

    def close(self) -> None:
        """Leave the ledger: the slot is cleared and freed."""
        with self._closing:
            led, index = self.ledger, self._index
            if led.fd < 0:
                return
            led.threads[index] = led.until[index] = led.floor[index] = 0
            led.pid[index] = 0
            led.free_slot(index)
            led.close()
