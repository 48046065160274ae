"""Where shadow forwards run (R4.5 amended): in ``SCHED_IDLE``, where a served forward
preempts them.

``ShadowProcess`` (what a deployment uses): a child process that puts itself in
``SCHED_IDLE`` before it loads its own backend, so every thread it makes (its lanes,
onnxruntime's session pools, torch's OpenMP teams) inherits the policy. Its weights are
mapped from the file the worker maps (``runtime/weights.py``): one copy in memory for both.
Where the worker's process made a zygote before it loaded (``zygote.py``), the first child
is that zygote, sharing the libraries' memory with the worker; otherwise, and for a respawn,
it is spawned.
The tuner freezes it (``pause``: SIGSTOP) while a served forward it times runs; it dies with
its worker even while frozen (PR_SET_PDEATHSIG with SIGKILL). A child that dies or hangs fails
the shadow it was running, is killed and reaped, and the next shadow starts a new one (the
shadow loop backs off between failures); ``close`` ends in bounded time. It shares no
lock with the worker, not even Python's GIL: a shadow thread of the worker's own process that
held the GIL while the kernel starved it (SCHED_IDLE on a busy host) would stall the served
forward waiting for the GIL (measured: served p99 12x worse on this shared host).

``idle_shadows``: the same in-process, on ``SCHED_IDLE`` lanes over the backend's twin (tests
that wrap a backend use it; it has that GIL hazard). The child's own side is
``shadow_child``; the tuner's thread that hands shadows over, ``shadow_loop.ShadowLoop``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_srun.runtime.backend import Backend
from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.types import ForwardResult, Manifest, TokenBatch
from vllm_srun.tuner import zygote
from vllm_srun.tuner.shadow_child import cpu_ticks, serve_shadows

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import Forward

log = logging.getLogger(__name__)


def idle_shadows(backend: Backend) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` on ``SCHED_IDLE`` lanes over the backend's twin (its pools made
    there), and how to shut those lanes down. ``forward(..., paid=True)`` runs on lanes at
    normal priority instead (a shadow the learning share pays for)."""
    context, normal = ThreadContext(idle=True), ThreadContext()
    twin = backend.twin()

    def forward(batch: TokenBatch, num_threads: int, paid: bool = False) -> ForwardResult:
        return (normal if paid else context).run(
            num_threads, lambda: twin.forward(batch, num_threads))

    def shutdown() -> None:
        context.shutdown()
        normal.shutdown()

    return forward, shutdown


# a forward whose child used no CPU time at all for this long, while not frozen by the tuner,
# is hung: the child is killed and the next shadow starts a new one. A child starved by
# served work still gets CPU (the kernel weighs an idle-class task 3 against a normal one's
# 1,024: a 10-ms tick every 3-4 s beside one busy thread per CPU); 30 s is far past that,
# and a hang costs learning 30 s
HANG_S = 30.0
# ``close`` waits this long for a shadow in flight, and as long again for the child to exit,
# before it kills the child: the longest shadows run about a second (FACTS.md)
CLOSE_WAIT_S = 5.0
POLL_S = 1.0  # how often a forward waiting for its answer checks the child's CPU time


class _Child:
    """One child process of a ``ShadowProcess``, and its end of the pipe."""

    def __init__(self, start, manifest: Manifest, backend: str, precision: str) -> None:
        """``start``: this process's ``zygote.Zygote`` (becomes the child) or a multiprocessing
        context (spawns it)."""
        self.frozen_ok = False
        self.frozen = False  # the tuner froze it (``pause``): no CPU time is no hang
        self.ended = False  # killed and reaped (``end``): the next forward starts another
        self.forked = isinstance(start, zygote.Zygote)  # already running once made
        if self.forked:
            self.process, self.conn, self.armed, self.loaded = start.spawn(
                serve_shadows, (manifest, backend), {"precision": precision})
            self._child_end = None
            return
        ctx = start
        self.conn, child = ctx.Pipe()
        self.armed = ctx.Event()  # set by the child once it dies with this process
        self.loaded = ctx.Event()  # ... and once its backend is loaded
        self.process = ctx.Process(target=serve_shadows,
                                   args=(child, manifest, backend, os.getpid(), self.armed,
                                         self.loaded, precision),
                                   name="vllm-srun-shadows", daemon=True)
        self._child_end = child

    def started(self) -> None:
        if self._child_end is not None:
            self._child_end.close()

    def end(self) -> None:
        """Kill it (a stopped one too) and reap it: no zombie stays behind."""
        self.ended, self.frozen = True, False
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.process.kill()
        with contextlib.suppress(OSError, ValueError, AssertionError):
            self.process.join(timeout=CLOSE_WAIT_S)
        self.conn.close()


class ShadowProcess:
    """Shadow forwards in a ``SCHED_IDLE`` child process with its own backend over the
    worker's weights file.
    A child that dies or hangs (no answer and no CPU time for ``hang_s``) fails the forward
    it was running (``RuntimeFault``), is killed and reaped, and the next forward starts a
    new one (``respawns``); the tuner's shadow loop backs off between them."""

    def __init__(self, manifest: Manifest, backend: str, precision: str = "float32",
                 hang_s: float = HANG_S) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._manifest, self._backend, self._precision = manifest, backend, precision
        self.hang_s = hang_s
        self.respawns = 0
        self._closed = False
        self._lock = threading.Lock()  # one forward at a time on the pipe
        # The kernel's parent-death signal follows the *thread* that forks the child: forked
        # from a worker's loader thread, the child was SIGKILLed when that thread ended. So
        # a thread of its own forks every child and lives until ``close``.
        self._forks: queue.Queue = queue.Queue()
        threading.Thread(target=self._fork_children, name="shadow-parent", daemon=True).start()
        self._child = self._start()

    @property
    def process(self):
        """The child process now (a new one after a respawn)."""
        return self._child.process

    @property
    def _armed(self):
        return self._child.armed

    @property
    def _loaded(self):
        return self._child.loaded

    def _fork_children(self) -> None:
        while (job := self._forks.get()) is not None:
            child, done, failed = job
            try:
                child.process.start()
            except BaseException as exc:  # raised again on the caller's thread
                failed.append(exc)
            done.set()

    def _start(self) -> _Child:
        if (forks := zygote.current()) is not None:
            try:
                return _Child(forks, self._manifest, self._backend, self._precision)
            except OSError as exc:  # the zygote died: spawned from here on
                log.warning("shadow_zygote_failed error=%s action=spawn", exc)
        child = _Child(self._ctx, self._manifest, self._backend, self._precision)
        done, failed = threading.Event(), []
        self._forks.put((child, done, failed))
        done.wait()
        child.started()
        if failed:
            raise failed[0]
        return child

    def forward(self, batch: TokenBatch, num_threads: int, paid: bool = False) -> ForwardResult:
        """One shadow forward in the child; ``paid``: the child runs it at normal priority
        (a shadow the learning share pays for), then goes back to ``SCHED_IDLE``."""
        with self._lock:
            if self._closed:
                raise RuntimeFault("shadow process closed")
            child = self._child
            if child.ended:  # the last one died or hung: a new one
                child = self._child = self._start()
                self.respawns += 1
                log.info("shadow_process_respawned respawns=%d pid=%d", self.respawns,
                         child.process.pid)
            try:
                if not child.process.is_alive():  # (and reaped)
                    raise EOFError(f"exit code {child.process.exitcode}")
                child.conn.send((batch.input_ids, batch.attention_mask, batch.token_type_ids,
                                 batch.raw_rows, num_threads, paid))
                ok, payload = self._receive(child)
            except (OSError, EOFError, _Hung) as exc:
                child.end()
                raise RuntimeFault(f"shadow process gone: {exc or type(exc).__name__}; "
                                   "the next shadow starts a new one") from exc
        if not ok:
            raise RuntimeFault(f"shadow forward failed: {payload}")
        return ForwardResult(*payload)

    def _receive(self, child: _Child):
        """The child's answer; ``_Hung`` once it used no CPU time for ``hang_s`` while not
        frozen by the tuner."""
        used, progress_at = None, time.monotonic()
        while not child.conn.poll(POLL_S):  # (a dead child's end reads as ready: EOF)
            now, ticks = time.monotonic(), cpu_ticks(child.process.pid)
            if child.frozen or ticks != used:
                used, progress_at = ticks, now
            elif now - progress_at >= self.hang_s:
                raise _Hung(f"no answer and no CPU time for {now - progress_at:.0f} s; "
                            "killed")
        return child.conn.recv()

    def pause(self, frozen: bool) -> bool:
        """Freeze the child (SIGSTOP) while a served forward that is timed runs, and thaw it
        (SIGCONT) after: a shadow then takes no CPU, cache or memory bandwidth from it.
        Returns whether the child is now frozen: never before it dies with this process, nor
        while it loads its backend (it runs no forward then; every freeze would wake each of
        its threads), nor once it is gone (a dead child is reaped here, not counted frozen)."""
        child = self._child
        if child.ended:
            return False
        if frozen and not child.frozen_ok:
            if not (child.armed.is_set() and child.loaded.is_set()):
                return False
            child.frozen_ok = True
        try:
            if not child.process.is_alive():
                child.frozen = False
                return False
            os.kill(child.process.pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        except (ProcessLookupError, ValueError):
            child.frozen = False
            return False
        child.frozen = frozen
        return frozen

    def close(self) -> None:
        """Ends the child within about ``3 * CLOSE_WAIT_S``: a shadow in flight gets
        ``CLOSE_WAIT_S`` to finish (else the child is killed under it), the child as long
        to exit when asked; then it is killed (a hung or stopped child too) and reaped."""
        self._closed = True
        child = self._child
        if not child.ended:
            if child.frozen:  # by the tuner: thawed to exit (SIGKILL ends it either way)
                self.pause(False)
            idle = self._lock.acquire(timeout=CLOSE_WAIT_S)
            if not idle:  # a shadow in flight did not end: its forward reads EOF and fails
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    child.process.kill()
                idle = self._lock.acquire(timeout=CLOSE_WAIT_S)
            try:
                if idle and not child.ended:
                    with contextlib.suppress(OSError, ValueError):
                        child.conn.send(None)
                    with contextlib.suppress(AssertionError):
                        child.process.join(timeout=CLOSE_WAIT_S)
            finally:
                if idle:
                    self._lock.release()
            child.end()
        self._forks.put(None)


class _Hung(Exception):
    """The shadow child gave no answer and used no CPU time for ``hang_s``."""


def shadow_process(manifest: Manifest, backend: str) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` served by a ``ShadowProcess``, and how to stop it."""
    proc = ShadowProcess(manifest, backend)
    return proc.forward, proc.close
