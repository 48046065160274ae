"""The HTTP front end (R7.1, R7.2): OpenAI-compatible embeddings, classify, models, health,
metrics. Errors are JSON ``{"error": {"code", "message"}}``; bad input never reaches a
worker and never costs another request its answer.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.errors import (
    DeadlineExceeded,
    EngineStopped,
    InputError,
    RuntimeFault,
    Unsupported,
)
from runtime.runner import Runner
from runtime.types import Task
from server.deployment import Deployment
from server.metrics import Metrics
from server.schemas import MAX_INPUTS, ClassifyBody, EmbeddingsBody, error_body

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-request-timeout-ms"
OFFLOAD_CHARS = 20_000  # tokenize bigger requests off the event loop
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


_FAULT_TO_STATUS: list[tuple[type[Exception], int, str]] = [
    (InputError, 400, "invalid_request"),
    (Unsupported, 422, "unsupported"),
    (DeadlineExceeded, 504, "deadline_exceeded"),
    (EngineStopped, 503, "not_ready"),
    (RuntimeFault, 500, "internal_error"),
]


@dataclass
class ServerOptions:
    max_body_bytes: int = 4 * 1024 * 1024
    served_names: tuple[str, ...] = ()


class ServerState:
    """The one deployment this server serves; loaded in the background after binding."""

    def __init__(self, deployment: Deployment, options: ServerOptions,
                 on_load_failure: Callable[[str], None] | None = None) -> None:
        self.deployment = deployment
        self.options = options
        self.metrics = Metrics()
        self.runner: Runner | None = None
        self.not_ready_reason = "loading"
        self._on_load_failure = on_load_failure

    def load_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._load_now, name="model-load", daemon=True)
        thread.start()
        return thread

    def _load_now(self) -> None:
        try:
            runner = self.deployment.load(on_forward=self.metrics.record_forward)
        except Exception as exc:
            self.not_ready_reason = f"load failed: {exc}"
            log.error("model_load_failed error=%s", exc)
            if self._on_load_failure:
                self._on_load_failure(str(exc))
            return
        self.runner = runner
        if runner.ready:
            self.metrics.ready.set(1)
        else:
            self.not_ready_reason = runner.not_ready_reason or "not ready"

    def runner_for(self, model: str | None) -> Runner:
        runner = self.runner
        if runner is None or not runner.ready:
            raise ApiError(503, "not_ready", f"model is not ready: {self.not_ready_reason}",
                           {"Retry-After": "1"})
        names = {runner.manifest.name, *self.options.served_names}
        if model is not None and model not in names:
            raise ApiError(404, "model_not_found",
                           f"model {model!r} is not served here; served: {sorted(names)}")
        return runner

    def close(self) -> None:
        if self.runner is not None:
            self.runner.stop()


def _json(payload: object, status: int = 200, headers: dict[str, str] | None = None):
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), status,
                    headers=headers, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return _json(error_body(exc.code, exc.message), exc.status, exc.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", f"request body is {declared} bytes; limit {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, "too_large", f"request body exceeds {limit} bytes")
    return bytes(body)


def _parse(raw: bytes, model: type[M]) -> M:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        if field == "input":
            msg = "input must be a string or a non-empty list of strings"
        else:
            msg = f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
        raise ApiError(400, "invalid_request", msg) from None


def _texts(value: object) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)  # type: ignore[arg-type]
    if not texts:
        raise ApiError(400, "invalid_request", "input must not be an empty list")
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(422, "unsupported", "token-id input is not supported; send text")
    if len(texts) > MAX_INPUTS:
        raise ApiError(413, "too_large", f"input has {len(texts)} items; limit {MAX_INPUTS}")
    for i, t in enumerate(texts):
        if not t:
            raise ApiError(400, "invalid_request", f"input[{i}] is an empty string")
    return texts


def _deadline(request: Request) -> float | None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ApiError(400, "invalid_request",
                       f"header {DEADLINE_HEADER} must be a positive integer, got {raw!r}")
    return time.monotonic() + int(raw) / 1000


async def _run(runner: Runner, texts: list[str], truncate: bool,
               deadline: float | None) -> tuple[np.ndarray, int]:
    limit = time.monotonic() + runner.args.timeout_ms / 1000
    deadline = limit if deadline is None else min(deadline, limit)
    if sum(len(t) for t in texts) > OFFLOAD_CHARS:
        future, tokens = await asyncio.to_thread(runner.submit, texts, truncate, deadline)
    else:
        future, tokens = runner.submit(texts, truncate, deadline)
    return await _answer(future, deadline), tokens


async def _answer(future: Future, deadline: float) -> np.ndarray:
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


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="vllm-srun", lifespan=lifespan)

    async def handle(endpoint: str, work) -> Response:
        try:
            response = await work()
            state.metrics.requests.labels(endpoint, "ok").inc()
            return response
        except ApiError as exc:
            state.metrics.requests.labels(endpoint, exc.code).inc()
            return _error(exc)
        except RuntimeFault as exc:
            status, code = next((s, c) for t, s, c in _FAULT_TO_STATUS if isinstance(exc, t))
            if status >= 500:
                log.warning("request_failed endpoint=%s code=%s error=%s", endpoint, code, exc)
            state.metrics.requests.labels(endpoint, code).inc()
            return _error(ApiError(status, code, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(error_body(code, str(exc.detail)), exc.status_code)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        async def work() -> Response:
            body = _parse(await _read_body(request, state.options.max_body_bytes),
                          EmbeddingsBody)
            runner = state.runner_for(body.model)
            texts = _texts(body.input)
            manifest = runner.manifest
            if manifest.task is not Task.EMBED:
                raise ApiError(422, "unsupported",
                               f"model {manifest.name!r} is a classifier; use /v1/classify")
            if body.dimensions is not None and body.dimensions != manifest.hidden_size:
                raise ApiError(422, "unsupported", f"dimensions must be {manifest.hidden_size} "
                               f"for {manifest.name!r}, got {body.dimensions}")
            vectors, tokens = await _run(runner, texts, body.truncate, _deadline(request))
            if body.encoding_format == "base64":
                data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
            else:
                data = list(vectors)
            return _json({
                "object": "list", "model": manifest.name,
                "data": [{"object": "embedding", "index": i, "embedding": e}
                         for i, e in enumerate(data)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        return await handle("embeddings", work)

    @app.post("/v1/classify")
    async def classify(request: Request) -> Response:
        async def work() -> Response:
            body = _parse(await _read_body(request, state.options.max_body_bytes), ClassifyBody)
            runner = state.runner_for(body.model)
            texts = _texts(body.input)
            manifest = runner.manifest
            if manifest.task is not Task.CLASSIFY:
                raise ApiError(422, "unsupported", f"model {manifest.name!r} has no "
                               "classification head; use /v1/embeddings")
            logits, tokens = await _run(runner, texts, body.truncate, _deadline(request))
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = shifted / shifted.sum(axis=1, keepdims=True)
            top_k = min(body.top_k or len(manifest.labels), len(manifest.labels))
            data = []
            for i, p in enumerate(probs):
                order = np.argsort(-p, kind="stable")[:top_k]
                data.append({"index": i, "label": manifest.labels[order[0]],
                             "score": float(p[order[0]]),
                             "scores": [{"label": manifest.labels[j], "score": float(p[j])}
                                        for j in order]})
            return _json({"object": "list", "model": manifest.name, "data": data,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        return await handle("classify", work)

    @app.get("/v1/models")
    async def models() -> Response:
        runner = state.runner
        data = []
        if runner is not None:
            m = runner.manifest
            data.append({"id": m.name, "object": "model", "created": 0, "owned_by": "vllm-srun",
                         "revision": m.revision, "task": m.task.value, "max_tokens": m.max_tokens,
                         "dimensions": m.hidden_size, "backend": runner.backend.name.value,
                         "num_threads": runner.args.num_threads})
        return _json({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if state.runner is None or not state.runner.ready:
            return _json(error_body("not_ready", state.not_ready_reason), 503)
        return _json({"status": "ok", "model": state.runner.manifest.name})

    @app.get("/v1/threads")
    async def threads() -> Response:
        return _json(state.deployment.threads_report(state.runner))

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.runner is not None:
            state.metrics.cache_hits.set(state.runner.cache.hits)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
