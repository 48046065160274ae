"""Where shadow forwards run (R4.5 amended): in ``SCHED_IDLE``, where a served forward
preempts them.

``ShadowProcess`` (what a deployment uses): a child process that puts itself in
``SCHED_IDLE`` before it loads its own copy of the backend, so every thread it makes (its
lanes, onnxruntime's session pools, torch's OpenMP teams) inherits the policy. The tuner
freezes it (``pause``: SIGSTOP) while a served forward it times runs; it dies with its
worker even while frozen (PR_SET_PDEATHSIG with SIGKILL). It shares no
lock with the worker, not even Python's GIL: a shadow thread of the worker's own process that
held the GIL while the kernel starved it (SCHED_IDLE on a busy host) would stall the served
forward waiting for the GIL (measured: served p99 12x worse on this shared host).

``idle_shadows``: the same in-process, on ``SCHED_IDLE`` lanes over the backend's twin (tests
that wrap a backend use it; it has that GIL hazard). ``ShadowLoop`` is the tuner's thread: it
only hands batches over and keeps the books, at normal priority, holding the tuner's lock for
bookkeeping only; a shadow starts only while no served forward runs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_srun.runtime.backend import Backend, load_backend
from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.lifetime import die_with_parent
from vllm_srun.runtime.threads import ThreadContext, make_process_idle
from vllm_srun.runtime.types import ForwardResult, Manifest, TokenBatch

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import AdaptiveThreads, Forward

log = logging.getLogger(__name__)


def idle_shadows(backend: Backend) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` on ``SCHED_IDLE`` lanes over the backend's twin (its pools made
    there), and how to shut those lanes down."""
    context = ThreadContext(idle=True)
    twin = backend.twin()

    def forward(batch: TokenBatch, num_threads: int) -> ForwardResult:
        return context.run(num_threads, lambda: twin.forward(batch, num_threads))

    return forward, context.shutdown


class ShadowProcess:
    """Shadow forwards in a ``SCHED_IDLE`` child process with its own copy of the backend."""

    def __init__(self, manifest: Manifest, backend: str, precision: str = "float32") -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._armed = ctx.Event()  # set by the child once it dies with this process
        self._loaded = ctx.Event()  # ... and once its backend is loaded
        self._frozen_ok = False
        self.process = ctx.Process(target=_serve_shadows,
                                   args=(child, manifest, backend, os.getpid(), self._armed,
                                         self._loaded, precision),
                                   name="vllm-srun-shadows", daemon=True)
        # The kernel's parent-death signal follows the *thread* that forks the child: forked
        # from a worker's loader thread, the child was SIGKILLed when that thread ended. So
        # a thread of its own forks it and lives until ``close``.
        self._closing, forked = threading.Event(), threading.Event()
        failed: list[BaseException] = []

        def parent() -> None:
            try:
                self.process.start()
            except BaseException as exc:  # raised again on the caller's thread
                failed.append(exc)
            forked.set()
            if not failed:
                self._closing.wait()

        threading.Thread(target=parent, name="shadow-parent", daemon=True).start()
        forked.wait()
        child.close()
        if failed:
            raise failed[0]
        self._lock = threading.Lock()

    def forward(self, batch: TokenBatch, num_threads: int) -> ForwardResult:
        with self._lock:
            try:
                self._conn.send((batch.input_ids, batch.attention_mask, batch.token_type_ids,
                                 batch.raw_rows, num_threads))
                ok, payload = self._conn.recv()
            except (OSError, EOFError) as exc:
                raise RuntimeFault(f"shadow process gone: {exc}") from exc
        if not ok:
            raise RuntimeFault(f"shadow forward failed: {payload}")
        return ForwardResult(*payload)

    def pause(self, frozen: bool) -> bool:
        """Freeze the child (SIGSTOP) while a served forward that is timed runs, and thaw it
        (SIGCONT) after: a shadow then takes no CPU, cache or memory bandwidth from it.
        Returns whether the child is now frozen: never before it dies with this process, nor
        while it loads its backend (it runs no forward then; every freeze would wake each of
        its threads), nor once it is gone."""
        if frozen and not self._frozen_ok:
            if not (self._armed.is_set() and self._loaded.is_set()):
                return False
            self._frozen_ok = True
        try:
            os.kill(self.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        except ProcessLookupError:
            return False
        return frozen

    def close(self) -> None:
        self.pause(False)
        with self._lock, contextlib.suppress(OSError):
            self._conn.send(None)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self._closing.set()
        self._conn.close()


def _serve_shadows(conn, manifest: Manifest, backend_name: str, parent: int, armed,
                   loaded, precision: str = "float32") -> None:
    die_with_parent(parent, signal.SIGKILL)  # SIGKILL: even while frozen
    armed.set()  # only now may the worker freeze it
    make_process_idle()  # every thread made from here on inherits it
    backend = load_backend(manifest, backend_name, precision=precision)
    loaded.set()
    context = ThreadContext()
    waits = RunDelay()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ids, mask, types, raw, n = msg  # the served batch as it ran (pairs, raw rows)
        batch = TokenBatch(ids, mask, types, raw)
        try:
            before = waits()
            r = context.run(n, lambda b=batch, k=n: backend.forward(b, k))
            after = waits()
            waited = None if before is None or after is None else max(0.0, after - before)
            conn.send((True, (r.outputs, r.num_threads, r.observed_threads, r.forward_s,
                              waited)))
        except Exception as exc:  # reported to the tuner, which logs it
            conn.send((False, repr(exc)))


class RunDelay:
    """Seconds this process's threads have spent runnable but not running, summed (the
    second field of ``/proc/self/task/<tid>/schedstat``): the shadow process is alone in
    ``SCHED_IDLE``, so any of it during a shadow is another task holding a CPU its forward
    wanted (measured here: under 0.05 of the forward's time on a quiet host, over 1.0 at 2
    threads beside one CPU-bound process, the forward then 3-100x slower). None where the
    kernel does not keep it."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def __call__(self) -> float | None:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        total = 0
        for tid in set(self._fds) - set(tids):  # a thread that ended
            os.close(self._fds.pop(tid))
        for tid in tids:
            try:
                fd = self._fds.get(tid)
                if fd is None:
                    fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat",
                                                  os.O_RDONLY)
                total += int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):
                return None
        return total / 1e9


def shadow_process(manifest: Manifest, backend: str) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` served by a ``ShadowProcess``, and how to stop it."""
    proc = ShadowProcess(manifest, backend)
    return proc.forward, proc.close


class ShadowLoop:
    """The tuner's own thread (normal priority: it holds the GIL and the tuner's lock only for
    bookkeeping): it warms every count on the shadow side, then runs due shadows whenever no
    served forward runs, and writes learnings to the record every ``flush_s``."""

    def __init__(self, tuner: AdaptiveThreads, warm: TokenBatch) -> None:
        self.tuner, self._warm = tuner, warm
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="shadows", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.tuner
        try:
            for n in t.counts:  # warm every count before it is timed
                t.run_shadow(self._warm, n)
            t.shadows_warm = True
            while not self._stop:
                if t.step():
                    continue
                if (t._dirty_samples or t._dirty_learned or t._unflushed_comparisons) and \
                        t.clock() - t._last_flush >= t.settings.flush_s:
                    t.flush()
                with t.lock:  # woken when a served forward ends, or a shadow may start
                    if not self._stop:
                        wait_s = 0.05 if t._jobs else t.settings.flush_s
                        if t._sharing_at > (now := t.clock()):
                            wait_s = min(wait_s, t._sharing_at - now)
                        t.lock.wait(timeout=wait_s)
        except Exception as exc:  # learning stops; serving goes on, and the report says why
            t.shadow_error = f"shadow forwards stopped: {exc}"
            log.exception("shadow_loop_failed")

    def stop(self) -> None:
        with self.tuner.lock:
            self._stop = True
            self.tuner.lock.notify_all()
        self.thread.join(timeout=60)
