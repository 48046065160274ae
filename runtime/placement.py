"""Where a multi-thread torch forward's threads run (R2.1): on distinct CPUs, from its start.

Why: a lane's OpenMP team (``threads.ThreadContext``) sleeps between forwards. Measured on a
2-vCPU VM (Linux 6.18, ``bench.spread_threads``), a 2-thread forward handed to a lane that had
run none for about 100 ms or more ran with its lead thread and its helper on one CPU for about
20 ms, the other CPU idle: 49 ms where back-to-back forwards took 28, as slow as one thread
(per-thread run-queue waits in ``/proc/<tid>/schedstat`` show the sharing). Mode 2 serving
2 threads between forwards at 1, and every shadow pass after a pause, met it on nearly every
forward at that count; so did the samples that choose the count.

How: the first forward at ``n >= 2`` on an OS thread makes its torch team exist and finds the
team's helpers (threads the lane created, which carry the lane's unique OS name). Then, for
each forward, the lead thread is held on the CPU it runs on and the helpers kept off that CPU
(free among the others the process may use), and the lead is released when the forward ends:
``n + 2`` system calls, about 7 microseconds for 2 threads here. Where the process may use
fewer CPUs than ``n``, or the lead's CPU cannot be read, nothing is held. The helpers' mask
stays as set while they sleep: the next forward on that lane sets it again.

``VLLM_SRUN_CPU_SPREAD_THREADS=0`` turns it off (the kernel alone places the threads).
Answers do not depend on it: a thread's share of each operation follows its number in the
team, not its CPU.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import sys
import threading
from collections.abc import Mapping

from vllm_srun.runtime.errors import ConfigError

log = logging.getLogger(__name__)

SPREAD_ENV = "VLLM_SRUN_CPU_SPREAD_THREADS"
_names = itertools.count(1)


def spread_threads(env: Mapping[str, str] | None = None) -> bool:
    """$VLLM_SRUN_CPU_SPREAD_THREADS: unset or 1 (hold a forward's threads on distinct
    CPUs, the default), 0 (leave them to the kernel)."""
    env = os.environ if env is None else env
    raw = env.get(SPREAD_ENV, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ConfigError(f"{SPREAD_ENV} must be unset, 1 (a forward's threads on distinct CPUs) "
                      f"or 0 (left to the kernel), got {env[SPREAD_ENV]!r}")


def _cpu_reader():
    try:
        return ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):  # not glibc or musl: nothing is held
        return None


_sched_getcpu = _cpu_reader()


def name_thread(kind: str, num_threads: int) -> str | None:
    """Give the calling OS thread a name no other thread of the process has (threads it
    creates from now on, its OpenMP helpers, inherit it): how ``Team.find`` knows them, and
    what ``top -H`` shows. None where no team needs it (one thread), on the main thread
    (its name is the process's), or where the name cannot be set."""
    if num_threads < 2 or threading.current_thread() is threading.main_thread():
        return None
    name = f"vs-{kind}{num_threads}-{next(_names)}"[:15]  # Linux keeps 15 bytes
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(name)
    except OSError:
        return None
    return name


class Team:
    """The helper threads of the calling thread's torch OpenMP team, and the hold of one
    forward (see the module docstring)."""

    __slots__ = ("helpers",)

    def __init__(self, helpers: tuple[int, ...]) -> None:
        self.helpers = helpers

    @classmethod
    def find(cls, num_threads: int, name: str | None) -> Team | None:
        """Make the calling thread's team of ``num_threads`` exist (one parallel operation)
        and return it; None where it has no helpers this thread's ``name`` finds, torch is
        not loaded, or spreading is off."""
        torch = sys.modules.get("torch")
        if num_threads < 2 or name is None or torch is None or _sched_getcpu is None or \
                not spread_threads():
            return None
        torch.ones(1 << 20).mul_(2)  # a parallel op over every thread of the team
        me, helpers = str(threading.get_native_id()), []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:  # it ended meanwhile
                continue
            if comm == name and tid != me:
                helpers.append(int(tid))
        return cls(tuple(helpers)) if helpers else None

    def hold(self) -> set[int] | None:
        """Hold the calling (lead) thread on its CPU and the helpers off it; returns the
        lead's mask to restore (``release``), or None where nothing was held."""
        if not self.helpers:
            return None
        allowed = os.sched_getaffinity(0)
        if len(allowed) <= len(self.helpers):  # fewer CPUs than the team's threads
            return None
        cpu = _sched_getcpu()
        if cpu not in allowed:
            return None
        others = allowed - {cpu}
        try:
            os.sched_setaffinity(0, {cpu})
            for tid in self.helpers:
                os.sched_setaffinity(tid, others)
        except OSError as exc:  # a helper is gone (its team was made again): hold no more
            os.sched_setaffinity(0, allowed)
            log.warning("spread_threads_stopped helpers=%s error=%s", self.helpers, exc)
            self.helpers = ()
            return None
        return allowed

    @staticmethod
    def release(allowed: set[int] | None) -> None:
        if allowed is not None:
            os.sched_setaffinity(0, allowed)
