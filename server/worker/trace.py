"""One request's trace: its id and the phases its time went to, gathered where they happen.

The front end's ``RequestTrace`` (``frontend/tracing.py``) begins a trace per HTTP request in
a context variable; code below it on the request's task adds to it without new arguments: the
in-process worker (``bridge.run``) notes the engine's ``RequestTiming``; a worker process
sends its timing back in the ``x-queue-ms`` / ``x-forward-ms`` headers of its answer, which
the pool's replica notes; the deployment pool notes its name and the prompt tokens. A worker
process begins its own trace per ``/work`` under the front end's request id, so its log lines
carry it too.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass

from vllm_srun.runtime.engine import RequestTiming

REQUEST_ID_HEADER = "x-request-id"
QUEUE_HEADER, FORWARD_HEADER = "x-queue-ms", "x-forward-ms"
MAX_REQUEST_ID = 128  # longer ids from a caller are replaced, not echoed


@dataclass
class Trace:
    request_id: str
    queue_s: float | None = None  # RequestTiming's phases, when a worker's engine ran it
    forward_s: float | None = None
    deployment: str | None = None  # the deployment that answered, and its prompt tokens
    tokens: int = 0

    def note_timing(self, timing: RequestTiming | None) -> None:
        if timing is not None:
            self.queue_s, self.forward_s = timing.queue_s, timing.forward_s

    def note_headers(self, headers) -> None:
        """A worker's timing headers (absent or malformed: nothing noted)."""
        try:
            queue, forward = float(headers[QUEUE_HEADER]), float(headers[FORWARD_HEADER])
        except (KeyError, TypeError, ValueError):
            return
        if queue >= 0 and forward >= 0:
            self.queue_s, self.forward_s = queue / 1000, forward / 1000

    def timing_headers(self) -> dict[str, str]:
        if self.queue_s is None or self.forward_s is None:
            return {}
        return {QUEUE_HEADER: f"{self.queue_s * 1000:.3f}",
                FORWARD_HEADER: f"{self.forward_s * 1000:.3f}"}


_current: ContextVar[Trace | None] = ContextVar("vllm_srun_trace", default=None)


def valid_request_id(value: str | None) -> bool:
    """A caller's id is echoed when it is 1-128 visible ASCII characters (no spaces or
    controls: it goes into headers and log lines as it is)."""
    return value is not None and 0 < len(value) <= MAX_REQUEST_ID and all(
        33 <= ord(c) <= 126 for c in value)


def new_request_id() -> str:
    return os.urandom(16).hex()


def begin(request_id: str | None) -> Trace:
    """A trace for the request now handled on this task, under the caller's id if valid."""
    trace = Trace(request_id if valid_request_id(request_id) else new_request_id())
    _current.set(trace)
    return trace


def current() -> Trace | None:
    return _current.get()
