"""The engine: micro-batches the rows of concurrent requests into forwards (R3.1, R3.3).

How it works: ``submit`` queues a request's rows and returns a future. A scheduler thread
loops: drop requests whose deadline passed or whose caller gave up, pick the next forward
with ``next_batch`` (policy), ask the threads policy which count serves it, run it on the
thread context's lane for that count, hand each row its vector, and resolve a request once
all its rows are done (a request is answered as one unit). With ``concurrent_forwards`` n
above 1, n such threads loop, each taking the next forward while the others run theirs
(fixed counts only: ``FixedThreads``); on a CPU whose forwards scale less than linearly with
threads, n forwards of t threads serve more than one of n x t. A row whose answer holds NaN or
infinity fails its request (``NonFiniteAnswer``, naming the input); the forward's other
requests are answered. The scheduler thread is itself a lane of one count (its *home*): a
forward at another count is handed to that count's lane and back, and where most forwards
come to be served at another count (mode 2 once it learned), the loop moves to a new thread
whose home is that count (``home.HomeWatch``). The threads policy hears when each
served forward begins (``served_threads``) and ends (``observe``); the adaptive tuner runs its
shadow passes on threads of its own and never on this one.

Invariant: every row of a live request is either pending or in a forward now running;
a forward's result for a request that expired meanwhile is discarded.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from vllm_srun.runtime.backend import Backend
from vllm_srun.runtime.batching import PendingRow, next_batch
from vllm_srun.runtime.errors import (
    DeadlineExceeded,
    EngineStopped,
    NonFiniteAnswer,
    RuntimeFault,
)
from vllm_srun.runtime.home import HomeWatch
from vllm_srun.runtime.threads import ThreadContext, thread_context
from vllm_srun.runtime.types import EngineArgs, ForwardRecord, ForwardResult, TokenBatch

log = logging.getLogger(__name__)


class ThreadsPolicy(Protocol):
    """Which count serves a forward (the tuner's seam). ``served_threads`` is asked right
    before each served forward starts and ``observe`` told right after it ends (``None``:
    it failed), so a policy knows when a served forward is running. An engine runs several
    forwards at once (``concurrent_forwards``) only with a policy whose ``several_at_once``
    is true: it is then asked and told from each forward's thread."""

    def served_threads(self, batch: TokenBatch) -> int: ...

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None: ...

    def close(self) -> None: ...


@dataclass
class FixedThreads:
    """Every forward at the configured count; no learning."""

    num_threads: int
    several_at_once: ClassVar[bool] = True

    def served_threads(self, batch: TokenBatch) -> int:
        return self.num_threads

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class RequestTiming:
    """Where a request's time in the engine went: ``queue_s`` from ``submit`` until the first
    forward carrying one of its rows started, ``forward_s`` from then until the last such
    forward ended (several forwards when its rows did not fit one)."""

    queue_s: float
    forward_s: float


class TimedFuture(Future):
    """A request's future; ``timing`` is set before it resolves with an answer."""

    timing: RequestTiming | None = None


@dataclass
class _Request:
    rows: list[list[int]]
    deadline: float  # time.monotonic() seconds
    future: TimedFuture
    outputs: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0
    type_ids: list[list[int]] | None = None  # text pairs only
    queued_at: float = 0.0  # time.monotonic() at submit
    started_at: float | None = None  # ... when its first forward started
    raw: bool = False  # answered before the model's last step (TokenBatch.raw_rows)


def pad(rows: list[list[int]], type_ids: list[list[int] | None] | None = None,
        raw: list[bool] | None = None, to: Callable[[int, int], int] | None = None
        ) -> TokenBatch:
    """Pad rows to the longest, or to ``to(rows, longest)`` tokens where given (mode 2's
    length grid); ``type_ids`` (text pairs) gives the token type ids, where a row without
    them (None) has zeros; ``raw`` marks the rows answered raw."""
    longest = max(len(r) for r in rows)
    if to is not None:
        longest = max(longest, to(len(rows), longest))
    ids = np.zeros((len(rows), longest), dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    types = None
    if type_ids is not None and any(t is not None for t in type_ids):
        types = np.zeros((len(rows), longest), dtype=np.int64)
        for i, t in enumerate(type_ids):
            if t is not None:
                types[i, : len(t)] = t
    raw_rows = np.array(raw, dtype=bool) if raw is not None and any(raw) else None
    return TokenBatch(ids, mask, types, raw_rows)


def stack_rows(outputs: list[np.ndarray]) -> np.ndarray:
    """One request's row answers as one array: vectors stack to [rows, dim]; per-token
    answers ([tokens, labels], each cut to its row's length) are zero-padded to the
    request's longest row: [rows, tokens, labels]."""
    if outputs[0].ndim == 1:
        return np.stack(outputs)
    longest = max(o.shape[0] for o in outputs)
    out = np.zeros((len(outputs), longest, outputs[0].shape[1]), dtype=np.float32)
    for i, o in enumerate(outputs):
        out[i, : o.shape[0]] = o
    return out


class Engine:
    def __init__(self, backend: Backend, args: EngineArgs,
                 threads: ThreadsPolicy | None = None, context: ThreadContext | None = None,
                 on_forward: Callable[[ForwardRecord], None] | None = None) -> None:
        self.backend = backend
        self.args = args
        self.threads = threads or FixedThreads(args.num_threads)
        self._check_policy()
        self.context = context or thread_context()
        # onnxruntime's count is the session's, not the OS thread's: any thread may run it
        self._inline = not getattr(backend, "thread_bound", True)
        # several forwards at once on a thread-bound backend: each engine thread has lanes of
        # its own, or two forwards at one count other than the configured would take turns
        # on the process's one lane of that count
        self._own_lanes = args.concurrent_forwards > 1 and not self._inline
        self.on_forward = on_forward
        # the padded length of a served forward from its rows and its longest row (mode 2:
        # ``sizes.padded_length``); None: the longest row
        self.pad_to: Callable[[int, int], int] | None = None
        self._cond = threading.Condition()
        self._requests: dict[int, _Request] = {}
        self._pending: list[PendingRow] = []
        self._ids = itertools.count()
        self._running = False
        self._threads: list[threading.Thread] = []
        self.forwards = 0
        self.non_finite = 0  # requests failed for a NaN or infinity in an answer

    def _check_policy(self) -> None:
        if self.args.concurrent_forwards > 1 and not getattr(self.threads, "several_at_once",
                                                              False):
            raise ValueError(f"several forwards at once need a threads policy that hears "
                             f"them ({type(self.threads).__name__} hears one served forward "
                             f"at a time)")

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._check_policy()  # the policy may have been set since (a worker's tuner)
        with self._cond:
            if self._running:
                return
            self._running = True
        n = self.args.concurrent_forwards
        self._threads = [threading.Thread(target=self._loop, daemon=True,
                                          name="engine" if n == 1 else f"engine-{i}")
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
            pending = list(self._requests.values())
            self._requests.clear()
            self._pending.clear()
        for req in pending:
            _fail(req.future, EngineStopped("engine stopped"))
        for thread in self._threads:
            thread.join(timeout=30)
        self.threads.close()

    # -- requests --------------------------------------------------------------------------
    def submit(self, rows: list[list[int]], deadline: float | None = None,
               type_ids: list[list[int]] | None = None, raw: bool = False) -> Future:
        """Queue a request's token rows (and their type ids, for text pairs; ``raw``: see
        ``TokenBatch.raw_rows``); the future gives float32 [len(rows), dim] (or
        [len(rows), tokens, labels], see stack_rows)."""
        future = TimedFuture()
        now = time.monotonic()
        limit = now + self.args.timeout_ms / 1000
        deadline = limit if deadline is None else min(deadline, limit)
        with self._cond:
            if not self._running:
                raise EngineStopped("engine is not running")
            rid = next(self._ids)
            self._requests[rid] = _Request(rows, deadline, future, [None] * len(rows), len(rows),
                                           type_ids, now, raw=raw)
            self._pending.extend(PendingRow(rid, i, len(r)) for i, r in enumerate(rows))
            self._cond.notify()
        return future

    def behind(self) -> bool:
        """More rows wait than one forward may take (``max_num_seqs``): the engine is falling
        behind its arrivals. Read without the lock from a forward's thread (a length read
        once; a policy asks it as a forward starts, after that forward's rows were taken)."""
        return len(self._pending) >= self.args.max_num_seqs

    def forward(self, rows: list[list[int]], num_threads: int) -> ForwardResult:
        """One direct forward at ``num_threads`` (warm-up, golden checks)."""
        return self.forward_batch(pad(rows), num_threads)

    def forward_batch(self, batch: TokenBatch, num_threads: int) -> ForwardResult:
        """One direct forward of a padded batch at ``num_threads`` (see ``_run``)."""
        return self._run(num_threads, lambda: self.backend.forward(batch, num_threads))

    def _run(self, num_threads: int, fn: Callable[[], ForwardResult],
             context: ThreadContext | None = None) -> ForwardResult:
        """``fn`` at ``num_threads``: on the calling thread where the backend's count is not
        the OS thread's (onnxruntime), else on the count's lane (of ``context``, else the
        engine's). A hop to a lane and back cost mode 2 serving 2 of 1 configured thread
        about 5% of a short forward here."""
        return fn() if self._inline else (context or self.context).run(num_threads, fn)

    # -- the loop --------------------------------------------------------------------------
    def _loop(self, home: int | None = None) -> None:
        home = home or self.args.num_threads
        self.context.adopt(home)
        lanes = ThreadContext() if self._own_lanes else None
        try:
            self._serve_until_stopped(lanes, home)
        finally:
            if lanes is not None:
                lanes.shutdown()

    def _movable(self) -> bool:
        """May the scheduler's home move (one loop, a thread-bound backend)?"""
        return self.args.concurrent_forwards == 1 and not self._inline

    def _move_home(self, home: int) -> bool:
        """Start the loop on a new thread whose home is ``home`` (``HomeWatch``); True when
        this thread is to end (False: the engine stops)."""
        with self._cond:
            if not self._running:
                return False
            thread = threading.Thread(target=self._loop, args=(home,), daemon=True,
                                      name="engine")
            self._threads.append(thread)
            thread.start()
        log.info("engine_home_moved to=%d", home)
        return True

    def _serve_until_stopped(self, lanes: ThreadContext | None, home: int) -> None:
        watch = HomeWatch(home) if self._movable() else None
        while True:
            with self._cond:
                self._expire(time.monotonic())
                if not self._pending and self._running:
                    self._cond.wait(timeout=0.5)
                    continue
                if not self._running:
                    return
                chosen = next_batch(self._pending, self.args.max_num_seqs,
                                    self.args.max_num_batched_tokens, self.pad_to)
                taken = set(chosen)
                self._pending = [r for r in self._pending if r not in taken]
                rows = [self._requests[r.request_id].rows[r.index] for r in chosen]
                started = time.monotonic()
                for r in chosen:
                    if (req := self._requests[r.request_id]).started_at is None:
                        req.started_at = started
                types = [t[r.index] if (t := self._requests[r.request_id].type_ids) else None
                         for r in chosen]
                raw = [self._requests[r.request_id].raw for r in chosen]
            if not chosen:
                continue
            n = self._serve(chosen, rows, types, raw, lanes)
            if watch is not None and n is not None and (
                    to := watch.served_at(n)) is not None and self._move_home(to):
                return

    def _serve(self, chosen: list[PendingRow], rows: list[list[int]],
               types: list[list[int] | None], raw: list[bool],
               lanes: ThreadContext | None = None) -> int | None:
        """One served forward of ``chosen``; the count it ran at (None: it failed)."""
        batch = pad(rows, types, raw, self.pad_to)
        num_threads = self.threads.served_threads(batch)
        try:
            result = self._run(num_threads, lambda: self.backend.forward(batch, num_threads),
                               lanes)
        except Exception as exc:
            self.threads.observe(batch, None)
            log.exception("forward_failed rows=%d", len(rows))
            self._fail_requests({r.request_id for r in chosen},
                                exc if isinstance(exc, RuntimeFault) else RuntimeFault(
                                    f"forward failed: {exc}"))
            return None
        with self._cond:
            self.forwards += 1
        self.threads.observe(batch, result)
        self._deliver(chosen, result.outputs)
        if self.on_forward is not None:
            self.on_forward(ForwardRecord(
                rows=batch.rows, padded_tokens=batch.padded_tokens, num_threads=num_threads,
                observed_threads=result.observed_threads, forward_s=result.forward_s,
                requests=len({r.request_id for r in chosen})))
        return num_threads

    def _deliver(self, chosen: list[PendingRow], outputs: np.ndarray) -> None:
        done: list[_Request] = []
        failed: dict[int, NonFiniteAnswer] = {}
        now = time.monotonic()
        with self._cond:
            self._expire(now)  # a result that came after its caller's deadline is discarded
            for row, vector in zip(chosen, outputs, strict=True):
                req = self._requests.get(row.request_id)
                if req is None or row.request_id in failed:  # gone while the forward ran
                    continue
                if vector.ndim == 2:  # per-token answer: cut the batch's padding off
                    vector = vector[: row.length]
                if not np.isfinite(vector).all():
                    failed[row.request_id] = NonFiniteAnswer(
                        f"the model answered NaN or infinity for input {row.index}: there is "
                        "no finite answer to return (another replica of this model answers "
                        "the same)")
                    continue
                req.outputs[row.index] = vector
                req.remaining -= 1
                if req.remaining == 0:
                    del self._requests[row.request_id]
                    done.append(req)
        for req in done:
            started = req.started_at if req.started_at is not None else now
            req.future.timing = RequestTiming(started - req.queued_at, now - started)
            _resolve(req.future, stack_rows(req.outputs))
        for rid, exc in failed.items():
            log.warning("non_finite_answer request=%d %s", rid, exc)
            self.non_finite += 1
            self._fail_requests({rid}, exc)

    def _expire(self, now: float) -> None:
        """Drop requests past their deadline or abandoned by their caller (lock held)."""
        gone = {rid for rid, req in self._requests.items()
                if req.future.done() or req.deadline <= now}
        if not gone:
            return
        self._pending = [r for r in self._pending if r.request_id not in gone]
        for rid in gone:
            req = self._requests.pop(rid)
            _fail(req.future, DeadlineExceeded("deadline passed before the forward ran"))

    def _fail_requests(self, ids: set[int], exc: Exception) -> None:
        with self._cond:
            reqs = [self._requests.pop(i) for i in ids if i in self._requests]
            self._pending = [r for r in self._pending if r.request_id not in ids]
        for req in reqs:
            _fail(req.future, exc)


def _resolve(future: Future, value: object) -> None:
    with contextlib.suppress(InvalidStateError):  # the caller cancelled it meanwhile
        future.set_result(value)


def _fail(future: Future, exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_exception(exc)
