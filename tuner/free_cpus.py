"""How much of its cores other tasks leave a worker, read from ``/proc`` (mode 2's contention
following, R4.5: the learned count takes its cores back once a neighbour has left them).

``FreeCpus()`` returns cumulative seconds: the idle (and iowait) time of the CPUs in this
process's affinity mask, plus the CPU time of this process, of the processes ``pids`` names
(its own shadow process), and of every process that yields to it (idle scheduling class, or
nice 15 and above: the kernel gives such a task a few percent of a core beside a normal one).
Over a window, their growth over the wall time is the cores the worker could have had; a
CPU-bound neighbour at normal priority takes one off it whatever count the worker serves and
however busy it is. Measured here (2 cores, 0.1-s windows, one core of ``sha256sum`` stopped
and continued every 2 s, wrk at 1 and 16 connections): other tasks held 0.9-1.1 cores with
the neighbour on while the worker served 1 thread, -0.1-0.1 with it stopped, whatever the
load. Idle time alone does not say it: a 2-thread onnxruntime worker spins its pool and
leaves no idle time either way. Yielding processes count as free because, where one runs on
idle time (another server's idle-class shadows, learning), it looked like a neighbour: a
mode 2 server beside a learning mode 1 server followed contention that was not there.

Yielding processes are found by a scan of ``/proc`` every ``scan_s`` (about 15 us a process).
Nothing here runs on the served path: a thread of its own reads the free seconds about every
``sample_s`` and keeps the last reading (``latest``, what the tuner reads: no file, no lock);
a process started since the last scan is a neighbour until the next. The workers of one host
read it out of step (R4.12): each reader starts at an offset of ``sample_s`` fixed by its
``worker`` id and waits ``sample_s`` +/- 20% between readings, drawn per id
(``cadence.waits``); each reading carries its own time, so the tuner's windows are unchanged.

Not seen: a cgroup quota below the mask (its throttled time reads as free), CPU time of these
processes spent outside the mask, and yielding threads of processes that are not. Where
``/proc`` cannot be read the reading is None and the tuner probes the learned count instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator

from vllm_srun.tuner.cadence import waits

# fields of /proc/<pid>/stat after the ")" that ends the command name
CPU_TIME_FIELDS = slice(11, 13)  # utime, stime
NICE_FIELD, POLICY_FIELD = 16, 38
SCHED_IDLE = 5
YIELDING_NICE = 15


class FreeCpus:
    def __init__(self, pids: Callable[[], Iterable[int]] = tuple,
                 cpus: Collection[int] | None = None, scan_s: float = 5.0,
                 sample_s: float = 0.05, rest_s: float = 1.0,
                 worker: str | None = None) -> None:
        """``sample_s``: 0.05, half the tuner's window (``contention_free_window_s``, 0.1 s):
        a whole window lies between two readings at most 0.16 s after it began (a wait is at
        most 0.06 s with the jitter, the module docstring says why it has one). A reading
        took 0.25 ms here (4 files at about 70 us each on this loaded 2-core host, one
        run), so 20 a second take 0.5% of a core: the reader rests once ``latest`` has not
        been asked for ``rest_s`` (1.0: ten windows, past which the tuner takes a reading
        as saying nothing of now anyway). ``worker``: the id that fixes the reader's phase
        and jitter (default: this process's pid)."""
        if cpus is None:  # (no affinity call off Linux, where /proc is missing too: None)
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
        self._names = {f"cpu{i}".encode() for i in cpus}
        self._tick = os.sysconf("SC_CLK_TCK")
        self._pids = pids
        self._yielding: tuple[int, ...] = ()
        self._stop = threading.Event()
        self.scan()
        self._latest = self._reading()
        self._asked_at = time.monotonic()
        spacing = waits(str(os.getpid()) if worker is None else worker, sample_s)
        threading.Thread(target=self._sample, args=(spacing, scan_s, rest_s),
                         name="free-cpus", daemon=True).start()

    def latest(self) -> tuple[float, float] | None:
        """The last reading: (when, on ``time.monotonic``; free CPU seconds so far), or None
        if unreadable. Reads no file: what the served path calls."""
        self._asked_at = time.monotonic()
        return self._latest

    def __call__(self) -> float | None:
        """Free CPU seconds so far (see the module docstring); None if unreadable."""
        try:
            with open("/proc/stat", "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            return None
        ticks = 0
        for line in lines[1:]:  # the first line sums every CPU
            if not line.startswith(b"cpu"):
                break  # the per-CPU lines come first
            parts = line.split()
            if parts[0] in self._names:
                ticks += int(parts[4]) + int(parts[5])  # idle, iowait
        for pid in {os.getpid(), *self._pids(), *self._yielding}:
            fields = _stat(pid)
            if fields is not None:  # else gone: it runs nothing
                ticks += sum(int(x) for x in fields[CPU_TIME_FIELDS])
        return ticks / self._tick

    def scan(self) -> None:
        """Find the processes that yield to a normal one (idle class, nice 15 and up)."""
        found = []
        try:
            entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
        except OSError:
            return
        for name in entries:
            fields = _stat(int(name))
            if fields is not None and (int(fields[POLICY_FIELD]) == SCHED_IDLE
                                       or int(fields[NICE_FIELD]) >= YIELDING_NICE):
                found.append(int(name))
        self._yielding = tuple(found)

    def close(self) -> None:
        self._stop.set()

    def _reading(self) -> tuple[float, float] | None:
        free_s = self()
        return None if free_s is None else (time.monotonic(), free_s)

    def _sample(self, spacing: Iterator[float], scan_s: float, rest_s: float) -> None:
        scanned = time.monotonic()
        while not self._stop.wait(next(spacing)):
            now = time.monotonic()
            if now - scanned >= scan_s:
                self.scan()
                scanned = now
            if now - self._asked_at <= rest_s:
                self._latest = self._reading()


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None
