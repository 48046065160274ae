"""How much of its cores other tasks leave a worker, read from ``/proc`` (mode 2's contention
following, R4.5: the learned count takes its cores back once a neighbour has left them).

``FreeCpus()`` returns cumulative seconds: the idle (and iowait) time of the CPUs in this
process's affinity mask, plus the CPU time of this process and of the processes ``pids``
names (the idle-class shadow process, which runs only on time nobody else wants). Over a
window, their growth over the wall time is the cores the worker could have had; a CPU-bound
neighbour takes one off it whatever count the worker serves and however busy it is. Measured
here (2 cores, 0.1-s windows, one core of ``sha256sum`` stopped and continued every 2 s, wrk
at 1 and 16 connections): other tasks held 0.9-1.1 cores with the neighbour on while the
worker served 1 thread, -0.1-0.1 with it stopped, whatever the load. Idle time alone does not
say it: a 2-thread onnxruntime worker spins its pool and leaves no idle time either way.

Not seen: a cgroup quota below the mask (its throttled time reads as free) and CPU time of
this process spent outside the mask. Where ``/proc`` cannot be read it returns None and the
tuner probes the learned count instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable

CPU_TIME_FIELDS = slice(11, 13)  # utime, stime in /proc/<pid>/stat after the ")" of comm


class FreeCpus:
    def __init__(self, pids: Callable[[], Iterable[int]] = tuple,
                 cpus: Collection[int] | None = None) -> None:
        if cpus is None:
            cpus = os.sched_getaffinity(0)
        self._names = {f"cpu{i}".encode() for i in cpus}
        self._tick = os.sysconf("SC_CLK_TCK")
        self._pids = pids

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
        for pid in (os.getpid(), *self._pids()):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue  # a shadow process that is gone: it runs nothing
            ticks += sum(int(x) for x in fields[CPU_TIME_FIELDS])
        return ticks / self._tick
