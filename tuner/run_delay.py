"""How long a shadow forward's own threads waited for a CPU another task held (R4.5).

The kernel keeps, per thread, the time it ran and the time it spent runnable but not running
(``/proc/self/task/<tid>/schedstat``: fields 1 and 2, in ns). The shadow process is alone in
``SCHED_IDLE``, so a wait during a shadow is another task holding a CPU its forward wanted.

Only the forward's own threads count. The shadow process also holds threads that take no
part in a forward at count ``n``: the intra-op pools of the other counts' sessions (an
onnxruntime pool thread spins for a while after its run, runnable all along), torch's OpenMP
teams of other lanes, the pipe's thread. On a busy host they wait as much as the forward's
threads, and summed with them the delay exceeded the forward's wall time (measured here with
``bench/shadow_vs_served.py`` at load 5 on 2 vCPUs: a 1-thread 1x16 forward of 4.9 ms "waited"
31.5 ms): every shadow then read as preempted, and ``samples.served_cost_ms`` made the rest
cost nothing. The forward's threads are the ``n`` that ran longest during it; each one's wait
counts up to the forward's wall time.
"""

from __future__ import annotations

import os

Snapshot = dict[str, tuple[int, int]]  # tid -> (ns on a CPU, ns runnable but not running)


class RunDelay:
    """Per-thread run and wait times of this process (``snapshot``); None where the kernel
    does not keep them."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def snapshot(self) -> Snapshot | None:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        for tid in set(self._fds) - set(tids):  # a thread that ended
            os.close(self._fds.pop(tid))
        out: Snapshot = {}
        for tid in tids:
            try:
                fd = self._fds.get(tid)
                if fd is None:
                    fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat",
                                                  os.O_RDONLY)
                ran, waited = os.pread(fd, 128, 0).split()[:2]
                out[tid] = (int(ran), int(waited))
            except FileNotFoundError:  # it ended between the listing and the read
                continue
            except (OSError, ValueError):
                return None
        return out


def forward_wait_s(before: Snapshot | None, after: Snapshot | None, threads: int,
                   wall_s: float) -> float | None:
    """Seconds the forward's own threads waited, summed: of the threads in ``after``, the
    ``threads`` that ran longest between the two snapshots, each one's wait capped at
    ``wall_s`` (module docstring). None if either snapshot is missing."""
    if before is None or after is None:
        return None
    deltas = []
    for tid, (ran, waited) in after.items():
        ran0, waited0 = before.get(tid, (0, 0))
        deltas.append((ran - ran0, max(0, waited - waited0)))
    deltas.sort(reverse=True)
    cap_ns = max(0.0, wall_s) * 1e9
    return sum(min(w, cap_ns) for _, w in deltas[:max(1, threads)]) / 1e9
