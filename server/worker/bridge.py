"""Awaiting an engine's answer from asyncio: shared by the worker process and the in-process
worker of the one-worker shorthand."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import numpy as np

from vllm_srun.runtime.errors import DeadlineExceeded
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import TextInput, input_chars
from vllm_srun.server.worker.trace import current

OFFLOAD_CHARS = 20_000  # tokenize bigger requests off the event loop

async def run(runner: Runner, texts: list[TextInput], truncate: bool,
              deadline: float | None, field: str = "input",
              raw: bool = False) -> tuple[np.ndarray, int]:
    limit = time.monotonic() + runner.args.timeout_ms / 1000
    deadline = limit if deadline is None else min(deadline, limit)
    if input_chars(texts) > OFFLOAD_CHARS:
        future, tokens = await asyncio.to_thread(runner.submit, texts, truncate, deadline,
                                                 field, raw)
    else:
        future, tokens = runner.submit(texts, truncate, deadline, field, raw)
    out = await answer(future, deadline)
    if (trace := current()) is not None:
        trace.note_timing(future.timing)
    return out, tokens


async def answer(future: Future, deadline: float) -> np.ndarray:
    """Await the engine's future until the deadline; on timeout or cancellation, cancel it so
    the engine drops the request's queued rows. (One loop future and one timer: cheaper than
    ``wait_for(wrap_future(...))`` on this per-request path.)"""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def done(f: Future) -> None:
        loop.call_soon_threadsafe(_settle, waiter, f)

    timer = loop.call_later(max(0.0, deadline - time.monotonic()), _expire, waiter)
    future.add_done_callback(done)
    try:
        return await waiter
    finally:
        timer.cancel()
        future.cancel()  # no-op once answered; else the engine drops the queued rows


def _settle(waiter: asyncio.Future, f: Future) -> None:
    if waiter.done():
        return
    if f.cancelled():
        waiter.set_exception(DeadlineExceeded("request was cancelled"))
    elif (exc := f.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(f.result())


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(DeadlineExceeded("deadline passed before the answer was ready"))
