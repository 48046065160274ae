"""The core ledger's file (R4.12, ``cores.py``): its layout, its mapping and its locks.

How it works: a header (``MAGIC``, ``VERSION``, ``SLOTS``) and then five int64 columns of
``SLOTS`` slots each, one per field (pid, threads, since and until in ``time.monotonic_ns``,
configured count), mapped by every worker that opens the file. Byte 0 carries the file
lock (``fcntl`` open-file-description locks): a check and the writes it makes happen under
it; bytes 1..``SLOTS`` carry each slot's lock, held by the slot's owner for as long as it
has the ledger open, which the kernel drops when the process ends, however it ends.

Invariant: each field is one aligned 8-byte store, so a reader without the file lock sees
a field's old value or its new one, never a mix.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"VSRUNCOR"
VERSION = 1
SLOTS = 128  # workers one ledger holds; a worker past them runs without the ledger
FIELDS = 5  # pid, threads, since and until (time.monotonic_ns), configured count
RUNNING = np.iinfo(np.int64).max  # ``until`` of a forward still running
HEADER_BYTES = 64
SLOT_BYTES = FIELDS * 8
SIZE_BYTES = HEADER_BYTES + SLOTS * SLOT_BYTES

# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0: an OFD lock)
_FLOCK = "hhqqi4x"
_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)
_SETLKW = getattr(fcntl, "F_OFD_SETLKW", fcntl.F_SETLKW)


class CoreShareError(Exception):
    """The ledger cannot be opened (the message names the file and why); the worker serves
    without it."""


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


def lock_file(fd: int, wait: bool = False) -> bool:
    """The file lock (byte 0); False if another open file holds it (and ``wait`` is
    False)."""
    return _try(fd, _TAKE, wait)


def unlock_file(fd: int) -> None:
    _try(fd, _DROP)


def open_fd(path: Path) -> int:
    """The ledger file's descriptor, the file (and its folder) created if new."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CoreShareError(f"cannot open core ledger {path}: {exc}") from exc


class LedgerFile:
    """The ledger mapped: its columns (``pid``, ``threads``, ``since``, ``until``,
    ``floor``: one int64 per slot each) and its locks."""

    def __init__(self, path: Path, fd: int) -> None:
        """Map the ledger at ``fd`` (under the file lock: one worker writes a new one)."""
        self.path, self.fd = path, fd
        self._mapped = _map(path, fd)
        columns = np.frombuffer(self._mapped, dtype=np.int64, count=FIELDS * SLOTS,
                                offset=HEADER_BYTES).reshape(FIELDS, SLOTS)
        self.pid, self.threads, self.since, self.until, self.floor = columns

    def take(self, wait: bool = False) -> bool:
        """The file lock; False if another worker holds it (and ``wait`` is False)."""
        return _try(self.fd, _TAKE, wait)

    def drop(self) -> None:
        _try(self.fd, _DROP)

    def take_slot(self, index: int) -> bool:
        """Slot ``index``'s lock: True if it is ours now (free, or its owner died)."""
        return _try(self.fd, _slot_lock(index, fcntl.F_WRLCK))

    def free_slot(self, index: int) -> None:
        _try(self.fd, _slot_lock(index, fcntl.F_UNLCK))

    def clear(self, index: int) -> None:
        """Slot ``index`` holds nothing and nobody."""
        self.threads[index] = self.until[index] = self.since[index] = 0
        self.floor[index] = self.pid[index] = 0

    def close(self) -> None:
        del self.pid, self.threads, self.since, self.until, self.floor  # (views)
        self._mapped.close()
        os.close(self.fd)
        self.fd = -1


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
