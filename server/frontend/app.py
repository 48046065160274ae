"""The HTTP front end's assembly (R7.1, R7.2): the server's state (its pool, metrics and
admission rule), the FastAPI app with the routes of ``routes.py``, and the ASGI layers around
it (API key, admission). Bad input never reaches a worker and never costs another request its
answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.server.frontend import infinity, tei
from vllm_srun.server.frontend.admission import Admission
from vllm_srun.server.frontend.auth import RequireApiKey
from vllm_srun.server.frontend.metrics import Metrics
from vllm_srun.server.frontend.routes import json_response, router
from vllm_srun.server.frontend.tracing import RequestTrace
from vllm_srun.server.pool.config import Config
from vllm_srun.server.pool.pool import Pool, PoolOptions
from vllm_srun.server.worker.protocol import error_body

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None  # Bearer key for all but /health, /metrics, docs (None: open)


class ServerState:
    """The pool this server dispatches to; its workers start after the socket is bound."""

    def __init__(self, config: Config, pool_options: PoolOptions, options: ServerOptions,
                 on_load_failure: Callable[[str], None] | None = None,
                 reload_config: Callable[[], Config] | None = None) -> None:
        self._config = config  # what start() publishes; the pool holds the current one
        self.options = options
        self.metrics = Metrics()
        self.pool = Pool(pool_options, self.metrics, on_load_failure=on_load_failure)
        self._reload_config = reload_config
        self.guard = RequireApiKey(None, options.api_key) if options.api_key else None
        self.admission = Admission(
            self.pool.saturated,
            lambda endpoint: self.metrics.requests.labels(endpoint, "overloaded").inc(),
            self.guard.allows if self.guard is not None else None)

    async def start(self) -> None:
        await self.pool.start(self._config)

    async def close(self) -> None:
        await self.pool.close()

    async def reload(self) -> dict | None:
        """Re-read the config (SIGHUP) and reconfigure; a bad config changes nothing."""
        if self._reload_config is None:
            return None
        try:
            config = self._reload_config()
            summary = await self.pool.reconfigure(config)
        except RuntimeFault as exc:
            log.error("reconfiguration_failed error=%s", exc)
            self.pool.record_event("reconfiguration_failed", str(exc))
            return None
        log.warning("reconfigured started=%s retired=%s kept=%s",
                    *(",".join(summary[k]) or "-" for k in ("started", "retired", "kept")))
        return summary

    def ready(self) -> tuple[bool, str]:
        ok, reason = self.pool.ready()
        self.metrics.ready.set(1 if ok else 0)
        return ok, reason


def create_app(state: ServerState, gate: bool = True):
    """The ASGI app: API key check, then the admission gate, then FastAPI's routes.
    ``gate=False`` where the HTTP protocol refuses overload already (``vllm-srun serve``):
    checking again per request would only cost time; a request the protocol let through
    (pipelined behind another) still gets its 429 from the pool."""
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP,  # reconfigure from the config file
                                    lambda: asyncio.ensure_future(state.reload()))
        yield
        await state.close()

    app = FastAPI(title="vllm-srun", lifespan=lifespan)
    app.state.server = state
    app.include_router(router)
    app.include_router(tei.router)  # text-embeddings-inference's routes (R7.5)
    app.include_router(infinity.router)  # infinity's, where its shapes differ
    app.add_exception_handler(StarletteHTTPException, _http_error)
    gated = state.admission.gate(app) if gate else app
    if state.guard is not None:
        state.guard.app = gated
        gated = state.guard
    # outermost: the request id, Server-Timing and request metrics cover 401s and 429s too
    return RequestTrace(gated, state.metrics, app.routes)


async def _http_error(_request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return json_response(error_body(code, str(exc.detail)), exc.status_code)
