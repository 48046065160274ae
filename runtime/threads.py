"""The per-process thread context (R2.1): every CPU forward states its intra-op count here.

How it works: the context keeps one *lane* per thread count, a single OS thread that runs
only forwards stated at that count. torch keeps its intra-op count per OS thread (OpenMP and
MKL are thread-local) but seeds a fresh thread from a process-global value and resets it on
the thread's first parallel op, and ``set_num_threads`` also touches process-global pools. So
a lane pins its count once, after forcing torch's lazy per-thread init, and re-checks it
before every forward; counts never change on a lane, so no forward inherits another's count,
however many engines share the process. onnxruntime fixes threads per session: its backend
keeps one session per count and the lane only carries the call. A torch forward at two or
more threads runs with its team held on distinct CPUs (``placement``): a lane's team woken
after a pause otherwise ran its threads on one CPU for tens of milliseconds.

An *idle* context (``ThreadContext(idle=True)``, the adaptive tuner's shadow forwards) puts
each lane in ``SCHED_IDLE`` before anything else runs on it, so the threads a backend creates
from that lane (torch's OpenMP team on its first parallel op, an onnxruntime session's
intra-op pool when the session is created there) inherit the policy: the kernel runs them
only on CPU time no normal thread wants, and preempts them when a served forward wakes.

Invariant: a callable submitted with ``run(n, fn)`` executes on a lane of count n of that
context (the shared one, or the caller's own thread when it adopted n), where
``torch.get_num_threads() == n`` whenever torch is loaded.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vllm_srun.runtime.placement import Team, name_thread

T = TypeVar("T")

log = logging.getLogger(__name__)

_local = threading.local()
_UNKNOWN = object()  # a lane whose torch team was not looked for yet
_set_lock = threading.Lock()
SCHED_IDLE_POLICY = 5  # the policy number Linux shows in /proc/<pid>/task/<tid>/sched


def make_idle() -> bool:
    """Put the calling OS thread (not the process: on Linux the call takes a thread id) in
    ``SCHED_IDLE``; threads it creates from now on inherit it. False where unsupported."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        log.warning("sched_idle_unavailable error=%s", exc)
        return False
    return True


def pin_torch_threads(num_threads: int) -> None:
    """Make the calling OS thread's torch intra-op count ``num_threads`` (no-op without torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if not getattr(_local, "torch_initialised", False):
        torch.get_num_threads()  # force torch's lazy per-thread init before setting
        _local.torch_initialised = True
    if torch.get_num_threads() != num_threads:
        with _set_lock:  # set_num_threads also resizes process-global pools
            torch.set_num_threads(num_threads)


def make_process_idle() -> bool:
    """Put every thread of this process in ``SCHED_IDLE`` (those an import already started,
    such as a BLAS pool, too); threads made later inherit it from their creator."""
    ok = make_idle()
    set_process_idle(True)
    return ok


def set_process_idle(idle: bool) -> bool:
    """Every thread of this process to ``SCHED_IDLE`` (``idle``) or back to ``SCHED_OTHER``.
    Leaving the idle class needs CAP_SYS_NICE or an RLIMIT_NICE above 0 (Linux); returns
    False where a thread could not be moved."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return False
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    ok = True
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # it ended meanwhile
            continue
        except OSError:
            ok = False
    return ok


def lane_threads() -> int | None:
    """The count of the lane the caller runs on, or None outside a lane."""
    return getattr(_local, "lane_threads", None)


class ThreadContext:
    """One per process: runs each forward on the lane of the count it states."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle
        self._lanes: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def _lane(self, num_threads: int) -> ThreadPoolExecutor:
        with self._lock:
            lane = self._lanes.get(num_threads)
            if lane is None:
                lane = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=f"{'shadow' if self.idle else 'forward'}-{num_threads}t",
                    initializer=self._init_lane, initargs=(num_threads, self))
                self._lanes[num_threads] = lane
            return lane

    @staticmethod
    def _init_lane(num_threads: int, owner: ThreadContext | None = None) -> None:
        idle = owner is not None and owner.idle
        if idle:
            make_idle()  # before torch's per-thread init creates anything on this thread
        _local.lane_threads = num_threads
        _local.lane_idle = idle
        # the helpers of the team this thread will lead carry the name (``placement``)
        _local.lane_name = name_thread("idle" if idle else "fwd", num_threads)
        pin_torch_threads(num_threads)

    @staticmethod
    def _call(num_threads: int, fn: Callable[[], T]) -> T:
        """``fn`` on this lane, its torch team held on distinct CPUs while it runs
        (``placement.Team``, found at the lane's first call with torch loaded)."""
        pin_torch_threads(num_threads)
        team = getattr(_local, "team", _UNKNOWN)
        if team is _UNKNOWN and "torch" in sys.modules:
            team = _local.team = Team.find(num_threads, getattr(_local, "lane_name", None))
        if not isinstance(team, Team):
            return fn()
        held = team.hold()
        try:
            return fn()
        finally:
            team.release(held)

    def run(self, num_threads: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` at ``num_threads`` intra-op threads and return its result: inline when
        the caller is itself a lane of that count, else on the shared lane."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if lane_threads() == num_threads and getattr(_local, "lane_idle", False) == self.idle:
            return self._call(num_threads, fn)
        return self._lane(num_threads).submit(self._call, num_threads, fn).result()

    @staticmethod
    def adopt(num_threads: int) -> None:
        """Make the calling thread a private lane of ``num_threads`` (an engine's own thread
        serves its configured count inline, saving two thread hops per forward)."""
        ThreadContext._init_lane(num_threads)

    def counts(self) -> list[int]:
        with self._lock:
            return sorted(self._lanes)

    def shutdown(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.shutdown(wait=True)


_context: ThreadContext | None = None
_context_lock = threading.Lock()


def thread_context() -> ThreadContext:
    """The shared per-process context."""
    global _context
    with _context_lock:
        if _context is None:
            _context = ThreadContext()
        return _context
