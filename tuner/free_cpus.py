"""How much of its cores other tasks leave a worker, read from ``/proc`` (an input to the
tuner's estimate, R4.13: ``contention.FreeCores``, ``samples.load_factor``; and the cores
the core ledger budgets by, R4.12).

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

Workers of one host that share its cores (R4.12: the core ledger's slots, ``siblings``) are
not neighbours: each reading gives this worker its fair share of what the pool of workers
could have had. Over each interval between readings the pool's free time is the free time
above plus every live sibling's CPU time; each sibling is charged what it used up to an
equal share of that (the pool over 1 + live siblings), and this worker gets the rest. With
every worker busy that is an equal share of the cores other tasks leave (eight workers, a
neighbour on 32 of 64 cores: 4 each); with its siblings idle, the whole of it; a sibling
that serves more than its share takes no more from this one than its share. Read as
neighbours, eight busy workers each saw the others' 56 threads as a neighbour's, and all
followed "contention" down to 1 thread and back at once (the simulated 64-core host).

The same readings say how many cores other tasks hold (``held``, what the core ledger
budgets by, R4.12): the CPUs less the pool's free time over a window, where the pool's is
this worker's and every sibling's, not a share of it.

Each reading adds the growth of every source (the CPUs' idle time, each process's CPU time)
since the last one; a source first seen adds nothing until its next reading, so a process
found by a scan, or a sibling that starts, adds its time from then on, not its whole life.

Not seen: a cgroup quota below the mask (its throttled time reads as free), CPU time of these
processes spent outside the mask, and yielding threads of processes that are not. Where
``/proc`` cannot be read the reading is None and the tuner scales nothing by it.
"""

from __future__ import annotations

import math
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
# what other tasks use under this many standard deviations of the reading's rounding
# (``FreeCpus.resolution_s``) reads as nothing: two, the usual bar for "more than noise";
# the worker's reading (``contention.FreeCores``) and the core ledger's (``held_cores``)
UNRESOLVED_SDS = 2


class FreeCpus:
    def __init__(self, pids: Callable[[], Iterable[int]] = tuple,
                 cpus: Collection[int] | None = None, scan_s: float = 5.0,
                 sample_s: float = 0.05, rest_s: float = 1.0,
                 worker: str | None = None,
                 siblings: Callable[[], Iterable[int]] = tuple, window_s: float = 0.1) -> None:
        """``sample_s``: 0.05, half the tuner's window (``contention_free_window_s``, 0.1 s):
        a whole window lies between two readings at most 0.16 s after it began (a wait is at
        most 0.06 s with the jitter, the module docstring says why it has one). A reading
        took 0.25 ms here (4 files at about 70 us each on this loaded 2-core host, one
        run), so 20 a second take 0.5% of a core: the reader rests once ``latest`` has not
        been asked for ``rest_s`` (1.0: ten windows, past which the tuner takes a reading
        as saying nothing of now anyway). ``worker``: the id that fixes the reader's phase
        and jitter (default: this process's pid). ``siblings``: the pids of the other workers
        sharing this host's cores (the core ledger's, ``CoreShare.sibling_pids``).
        ``window_s``: the shortest stretch ``held`` reads over (the tuner's
        ``contention_free_window_s``, 0.1: a few forwards, and a neighbour's change shows in
        at most two readings of it)."""
        if cpus is None:  # (no affinity call off Linux, where /proc is missing too: None)
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
        self._names = {f"cpu{i}".encode() for i in cpus}
        self._cpus, self._window_s = len(self._names), window_s
        self._tick = os.sysconf("SC_CLK_TCK")
        self._pids, self._siblings = pids, siblings
        self._yielding: tuple[int, ...] = ()
        self._last: tuple[dict[object, int], dict[int, int]] | None = None  # ticks per source
        self._shared_ticks = 0.0  # this worker's share of the free ticks so far
        self._pool_ticks = 0.0  # the pool's free ticks so far (this worker's and siblings')
        self._pool_mark: tuple[float, float] | None = None  # (when, pool ticks): a window
        self._held: tuple[float, float] | None = None  # (when, cores other tasks held)
        self._resolution_s = 0.0  # see ``resolution_s``
        self._stop = threading.Event()
        self.scan()
        self._latest = self.sample()
        self._asked_at = time.monotonic()
        spacing = waits(str(os.getpid()) if worker is None else worker, sample_s)
        threading.Thread(target=self._sample, args=(spacing, scan_s, rest_s),
                         name="free-cpus", daemon=True).start()

    def latest(self) -> tuple[float, float] | None:
        """The last reading: (when, on ``time.monotonic``; free CPU seconds so far), or None
        if unreadable. Reads no file: what the served path calls."""
        self._asked_at = time.monotonic()
        return self._latest

    def resolution_s(self) -> float:
        """The standard deviation, in seconds, that rounding puts in the difference between
        two readings: each source's time is counted in whole ticks (``SC_CLK_TCK``), so a
        difference of one source's count is off by the difference of two roundings, up to a
        tick either way (variance 1/6 tick squared), and a reading sums that of each counter
        (each CPU's idle and iowait, each process's user and system time)."""
        return self._resolution_s

    def held(self) -> float | None:
        """The cores other tasks held over the last whole window of at least ``window_s``
        between two readings: the CPUs less what the pool could have had over it (idle time,
        this worker's, its shadow's, the yielding processes' and its siblings' CPU time);
        None where ``/proc`` cannot be read, or the last window ended more than ten windows
        ago (the reader rests while nobody asks). Reads no file: the core ledger calls it on
        the served path."""
        self._asked_at = now = time.monotonic()
        got = self._held
        return None if got is None or now - got[0] > 10 * self._window_s else got[1]

    def __call__(self) -> float | None:
        """Free CPU seconds so far (see the module docstring; siblings' time not counted);
        None if unreadable."""
        got = self._ticks(())
        return None if got is None else sum(got[0].values()) / self._tick

    def _ticks(self, siblings: Iterable[int]) -> tuple[dict[object, int], dict[int, int]] | None:
        """Ticks so far per free source (``"idle"``, and each readable process of this one,
        the named, the yielding) and per live sibling; None if ``/proc/stat`` is unreadable."""
        try:
            with open("/proc/stat", "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            return None
        idle = 0
        for line in lines[1:]:  # the first line sums every CPU
            if not line.startswith(b"cpu"):
                break  # the per-CPU lines come first
            parts = line.split()
            if parts[0] in self._names:
                idle += int(parts[4]) + int(parts[5])  # idle, iowait
        free: dict[object, int] = {"idle": idle}
        for pid in {os.getpid(), *self._pids(), *self._yielding}:
            if (ticks := _cpu_ticks(pid)) is not None:  # else gone: it runs nothing
                free[pid] = ticks
        own = set(free)
        return free, {pid: t for pid in siblings if pid not in own
                      and (t := _cpu_ticks(pid)) is not None}

    def sample(self) -> tuple[float, float] | None:
        """A reading now (what the sampler thread keeps as ``latest``): (when, this worker's
        free CPU seconds so far, its share where siblings share the cores), or None if
        unreadable."""
        got = self._ticks(tuple(self._siblings()))
        if got is None:
            return None
        if self._last is not None:
            sources, siblings = grown(got[0], self._last[0]), grown(got[1], self._last[1])
            free = sum(sources)
            # idle and iowait per CPU (one "idle" source); user and system per process
            counters = 2 * self._cpus + 2 * (len(sources) - 1) + 2 * len(siblings)
            self._resolution_s = math.sqrt(counters / 6) / self._tick
            self._shared_ticks += share_of_pool(free, siblings)
            self._pool_ticks += free + sum(siblings)
        self._last = got
        now = time.monotonic()
        self._note_held(now)
        return now, self._shared_ticks / self._tick

    def _note_held(self, now: float) -> None:
        """Close a window once it is ``window_s`` long (``held``)."""
        mark = self._pool_mark
        if mark is not None and now - mark[0] < self._window_s:
            return
        if mark is not None:
            span = now - mark[0]
            pool = (self._pool_ticks - mark[1]) / self._tick / span
            self._held = (now, held_cores(self._cpus, pool, self._resolution_s / span))
        self._pool_mark = (now, self._pool_ticks)

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

    def _sample(self, spacing: Iterator[float], scan_s: float, rest_s: float) -> None:
        scanned = time.monotonic()
        while not self._stop.wait(next(spacing)):
            now = time.monotonic()
            if now - scanned >= scan_s:
                self.scan()
                scanned = now
            if now - self._asked_at <= rest_s:
                self._latest = self.sample()


def held_cores(cpus: int, pool: float, resolution: float) -> float:
    """The cores other tasks held over a window: the ``cpus`` less the ``pool``'s free cores
    over it, less twice the standard deviation that rounding puts in that reading
    (``resolution``, in cores over the window): what the reading cannot resolve reads as
    nothing held, as for the worker's own reading (``contention.FreeCores``). Over 0.1 s on
    2 CPUs that is 0.23 core, under the core ledger's half-core slack; on 64 CPUs with 8
    workers and their shadow processes (160 rounded counters) about 1 core, and with the
    slack alone the ledger would take a thread off the pool in about one window in six with
    nothing else running (computed from the rounding, not measured on such a host)."""
    return max(0.0, cpus - pool - UNRESOLVED_SDS * resolution)


def grown(now: dict, before: dict) -> list[int]:
    """How much each source read both times grew in between (one first seen adds nothing)."""
    return [max(0, v - before[k]) for k, v in now.items() if k in before]


def share_of_pool(free: float, siblings_used: list[float]) -> float:
    """This worker's share of an interval's free time (see the module docstring): the pool's
    (``free`` plus what the live siblings used) less what each sibling used, up to an equal
    share of the pool each."""
    pool = free + sum(siblings_used)
    fair = pool / (1 + len(siblings_used))
    return max(0.0, pool - sum(min(used, fair) for used in siblings_used))


def _cpu_ticks(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else sum(int(x) for x in fields[CPU_TIME_FIELDS])


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None
