"""Where shadow forwards run (R4.5 amended): in ``SCHED_IDLE``, where a served forward
preempts them.

``ShadowProcess`` (what a deployment uses): a child process that puts itself in
``SCHED_IDLE`` before it loads its own backend, so every thread it makes (its lanes,
onnxruntime's session pools, torch's OpenMP teams) inherits the policy. Its weights are
mapped from the file the worker maps (``runtime/weights.py``): one copy in memory for both.
The tuner freezes it (``pause``: SIGSTOP) while a served forward it times runs; it dies with
its worker even while frozen (PR_SET_PDEATHSIG with SIGKILL). A child that dies or hangs fails
the shadow it was running, is killed and reaped, and the next shadow starts a new one (the
shadow loop backs off between failures); ``close`` ends in bounded time. It shares no
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
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_srun.runtime.backend import Backend, load_backend
from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.lifetime import die_with_parent
from vllm_srun.runtime.threads import ThreadContext, make_process_idle, set_process_idle
from vllm_srun.runtime.types import ForwardResult, Manifest, TokenBatch
from vllm_srun.tuner.run_delay import RunDelay, forward_wait_s

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import AdaptiveThreads, Forward

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

    def __init__(self, ctx, manifest: Manifest, backend: str, precision: str) -> None:
        self.conn, child = ctx.Pipe()
        self.armed = ctx.Event()  # set by the child once it dies with this process
        self.loaded = ctx.Event()  # ... and once its backend is loaded
        self.frozen_ok = False
        self.frozen = False  # the tuner froze it (``pause``): no CPU time is no hang
        self.ended = False  # killed and reaped (``end``): the next forward starts another
        self.process = ctx.Process(target=_serve_shadows,
                                   args=(child, manifest, backend, os.getpid(), self.armed,
                                         self.loaded, precision),
                                   name="vllm-srun-shadows", daemon=True)
        self._child_end = child

    def started(self) -> None:
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
            now, ticks = time.monotonic(), _cpu_ticks(child.process.pid)
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


def _cpu_ticks(pid: int) -> int | None:
    """CPU time of a process, all its threads, in clock ticks; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _serve_shadows(conn, manifest: Manifest, backend_name: str, parent: int, armed,
                   loaded, precision: str = "float32") -> None:
    die_with_parent(parent, signal.SIGKILL)  # SIGKILL: even while frozen
    armed.set()  # only now may the worker freeze it
    make_process_idle()  # every thread made from here on inherits it
    backend = load_backend(manifest, backend_name, precision=precision)
    loaded.set()
    context = ThreadContext()
    waits = RunDelay()  # the forward's own threads' waits (``run_delay``)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ids, mask, types, raw, n, paid = msg  # the served batch as it ran (pairs, raw rows)
        batch = TokenBatch(ids, mask, types, raw)
        try:
            if paid and not set_process_idle(False):  # normal priority for this job only
                log.warning("paid_shadow_priority_unavailable action=run_idle")
            try:
                r, waited = context.run(n, lambda b=batch, k=n: _waited(waits, backend, b, k))
            finally:
                if paid:
                    set_process_idle(True)
            conn.send((True, (r.outputs, r.num_threads, r.observed_threads, r.forward_s,
                              waited)))
        except Exception as exc:  # reported to the tuner, which logs it
            conn.send((False, repr(exc)))


def _waited(waits: RunDelay, backend: Backend, batch: TokenBatch, n: int
            ) -> tuple[ForwardResult, float | None]:
    """A forward on its lane, with its threads' waits over just its own time (a lane that
    waited to be woken is not the count's cost either)."""
    before = waits.snapshot()
    r = backend.forward(batch, n)
    return r, forward_wait_s(before, waits.snapshot(), n, r.forward_s)


def shadow_process(manifest: Manifest, backend: str) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` served by a ``ShadowProcess``, and how to stop it."""
    proc = ShadowProcess(manifest, backend)
    return proc.forward, proc.close


# after a shadow forward fails (its process died, hung, or the forward raised), the shadow
# loop waits this long before the next, doubling with each failure in a row up to the most:
# a one-off death (the OOM killer, an operator) costs learning a second; a child that dies
# at every start (a broken install) loads the model at most once a minute (idle class)
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# ``stop`` waits this long for a shadow in flight before the tuner closes the shadow side
# under it (which ends a hung one): the longest shadows run about a second (FACTS.md)
STOP_WAIT_S = 5.0


class ShadowLoop:
    """The tuner's own thread (normal priority: it holds the GIL and the tuner's lock only for
    bookkeeping): it warms every count on the shadow side, then runs due shadows whenever no
    served forward runs, and writes learnings to the record every ``flush_s``. A shadow
    forward that fails (``RuntimeFault``) is counted (``shadow_faults``) and retried after a
    backoff (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``); a ``ShadowProcess`` starts a new
    child for it. Any other error stops learning; serving goes on, and the report says why."""

    def __init__(self, tuner: AdaptiveThreads, warm: TokenBatch) -> None:
        self.tuner, self._warm = tuner, warm
        self._stop = False
        self._retry_s = 0.0  # the backoff after the last failure in a row; 0 after a success
        self.thread = threading.Thread(target=self._run, name="shadows", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.tuner
        while not self._stop:
            try:
                self._learn()
            except RuntimeFault as exc:
                if self._stop:  # the tuner closed the shadow side under a shadow in flight
                    return
                self._failed(exc)
            except Exception as exc:  # learning stops; serving goes on, the report says why
                t.side.error = f"shadow forwards stopped: {exc}"
                log.exception("shadow_loop_failed")
                return

    def _learn(self) -> None:
        t = self.tuner
        if not t.side.warm:
            for n in t.counts:  # warm every count before it is timed
                t.run_shadow(self._warm, n)
            t.side.warm = True
        while not self._stop:
            if t.step():
                self._retry_s = 0.0
                continue
            if t.flush_due():
                t.flush()
            if t.side.verifier.step():  # nothing else due: verify a shape (mode 2)
                self._retry_s = 0.0
                continue
            with t.lock:  # woken when a served forward ends, or a shadow may start
                if not self._stop:
                    wait_s = 0.05 if t.learner.board.jobs or t.side.verifier.pending() else \
                        t.settings.flush_s
                    if t.gate.sharing_at > (now := t.clock()):
                        wait_s = min(wait_s, t.gate.sharing_at - now)
                    t.lock.wait(timeout=wait_s)

    def _failed(self, exc: RuntimeFault) -> None:
        """A shadow forward failed: count it, say so, and wait out the backoff."""
        t = self.tuner
        self._retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * self._retry_s))
        with t.lock:
            t.side.faults += 1
            t.side.error = (f"shadow forwards failed {t.side.faults} time(s), retried "
                              f"after a backoff; the last: {exc}")
            log.warning("shadow_forward_failed faults=%d retry_s=%.0f error=%s",
                        t.side.faults, self._retry_s, exc)
            end = time.monotonic() + self._retry_s
            while not self._stop and (left := end - time.monotonic()) > 0:
                t.lock.wait(timeout=left)

    def stop(self, wait_s: float = 60.0) -> bool:
        """Ask the loop to end; wait up to ``wait_s`` for it. Returns whether it ended."""
        with self.tuner.lock:
            self._stop = True
            self.tuner.lock.notify_all()
        self.thread.join(timeout=wait_s)
        return not self.thread.is_alive()
