"""Every HTTP answer's request id, timing and metrics: the front end's outermost ASGI layer.

Each request gets an ``x-request-id`` (the caller's, echoed when valid: 1-128 visible ASCII
characters; else a new random one) on every answer, errors included, and a ``Server-Timing``
header (W3C: ``queue;dur=<ms>, forward;dur=<ms>, total;dur=<ms>``; queue and forward only
where a worker's engine ran the request). It runs outside the API key check and the admission
gate, so their 401 and 429 answers carry both too; the prebuilt 429 that ``vllm-srun serve``
writes at header time gets its request id in ``admission.py``. When the answer ends it is
counted in ``/metrics`` (duration by route and status class; the engine's queue wait and the
prompt tokens by deployment) and logged as one ``request`` line at DEBUG.
"""

from __future__ import annotations

import logging
import time

from vllm_srun.server.frontend.metrics import Metrics
from vllm_srun.server.worker import trace as traces

log = logging.getLogger("vllm_srun.access")


def server_timing(trace: traces.Trace, total_s: float) -> str:
    """The ``Server-Timing`` value: the phases known so far, then the total, in ms."""
    parts = [] if trace.queue_s is None else [f"queue;dur={trace.queue_s * 1000:.3f}",
                                              f"forward;dur={trace.forward_s * 1000:.3f}"]
    return ", ".join([*parts, f"total;dur={total_s * 1000:.3f}"])


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class RequestTrace:
    """ASGI middleware around ``app``; ``routes`` lists the paths the app serves (what the
    ``route`` label may be; any other path counts as ``other``)."""

    def __init__(self, app, metrics: Metrics, routes) -> None:
        self.app, self.metrics, self._routes = app, metrics, routes
        self._known: frozenset[str] | None = None

    def route(self, scope) -> str:
        if (matched := scope.get("route")) is not None and hasattr(matched, "path"):
            return matched.path
        if self._known is None:  # routes are all added before the first request
            self._known = frozenset(p for r in self._routes if (p := getattr(r, "path", None)))
        return scope["path"] if scope["path"] in self._known else "other"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        trace = traces.begin(given.decode("latin-1") if given is not None else None)
        rid = trace.request_id.encode()
        status = 500

        async def traced(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                timing = server_timing(trace, time.perf_counter() - started).encode()
                message = {**message, "headers": [*message.get("headers", ()),
                                                   (b"x-request-id", rid),
                                                   (b"server-timing", timing)]}
            await send(message)

        try:
            await self.app(scope, receive, traced)
        finally:
            self._done(scope, trace, status, time.perf_counter() - started)

    def _done(self, scope, trace: traces.Trace, status: int, total_s: float) -> None:
        route = self.route(scope)
        self.metrics.request_done(route, status_class(status), total_s, trace)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request method=%s route=%s status=%d duration_ms=%.3f request_id=%s "
                      "deployment=%s tokens=%d", scope["method"], route, status,
                      total_s * 1000, trace.request_id, trace.deployment or "-", trace.tokens)
