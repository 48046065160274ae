"""The HTTP front end (R7.1, R7.2, R7.4): OpenAI-compatible embeddings, classify (sequence and
token classification), rerank, models, health, metrics. Errors are JSON
``{"error": {"code", "message"}}``; bad input never reaches a worker and never costs another
request its answer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import Callable
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

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import Task
from vllm_srun.server.bridge import OFFLOAD_CHARS, fault_status
from vllm_srun.server.config import Config
from vllm_srun.server.metrics import Metrics
from vllm_srun.server.pool import DeploymentPool, Pool, PoolError, PoolOptions
from vllm_srun.server.replicas import ExchangeError
from vllm_srun.server.schemas import (
    MAX_INPUTS,
    ClassifyBody,
    EmbeddingsBody,
    RerankBody,
    error_body,
)
from vllm_srun.server.tasks import (
    RerankInputError,
    entities_answer,
    rerank_answer,
    rerank_pairs,
    task_mismatch,
)

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-request-timeout-ms"
REPLICA_HEADER = "x-vllm-srun-replica"
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


@dataclass
class ServerOptions:
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None  # Bearer key for /v1/* (None: open)


class AdmissionGate:
    """ASGI: when every replica is full, inference requests get their 429 before FastAPI
    reads, parses or routes them, so refusing a flood costs the front end little and the
    admitted requests keep their share of the event loop."""

    PATHS = (b"/v1/embeddings", b"/v1/classify", b"/v1/rerank")

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        self.body = orjson.dumps(error_body(
            "overloaded", "every ready replica has 32 requests in flight"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].encode() in self.PATHS \
                and self.state.pool.saturated():
            self.state.metrics.requests.labels(scope["path"].rsplit("/", 1)[-1],
                                               "overloaded").inc()
            await send({"type": "http.response.start", "status": 429, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": self.body})
            return
        await self.app(scope, receive, send)


class RequireApiKey:
    """ASGI guard: every ``/v1/`` path needs ``Authorization: Bearer <key>``, compared in
    constant time. ``/health`` (probes), ``/metrics`` (scrapes) and the OpenAPI document stay
    open; they carry no inference and no inventory."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = orjson.dumps(error_body(
                    "unauthorized", "missing or wrong API key: send 'Authorization: Bearer "
                                    "<key>' (see --api-key / VLLM_SRUN_API_KEY)"))
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class ServerState:
    """The pool this server dispatches to; its workers start after the socket is bound."""

    def __init__(self, config: Config, pool_options: PoolOptions, options: ServerOptions,
                 on_load_failure: Callable[[str], None] | None = None,
                 reload_config: Callable[[], Config] | None = None) -> None:
        self._config = config  # what start() publishes; the pool holds the current one
        self.options = options
        self.metrics = Metrics()
        self.pool = Pool(pool_options, self.metrics, on_forward=self.metrics.record_forward,
                         on_load_failure=on_load_failure)
        self._reload_config = reload_config

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
            return None
        log.warning("reconfigured %s", summary)
        return summary

    def ready(self) -> tuple[bool, str]:
        ok, reason = self.pool.ready()
        self.metrics.ready.set(1 if ok else 0)
        return ok, reason


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


async def _infer(dep: DeploymentPool, texts: list, truncate: bool, deadline: float | None,
                 field: str = "input") -> tuple[np.ndarray, int, dict[str, str]]:
    """Dispatch; returns rows, prompt tokens and the header naming the replica that answered."""
    out, tokens, replica = await dep.infer(texts, truncate, deadline, field)
    return out, tokens, {REPLICA_HEADER: replica}


async def _off_loop(chars: int, fn, *args):
    """``fn(*args)``; off the event loop when the input is big enough to tokenize slowly."""
    if chars > OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _body_schema(model: type[BaseModel]) -> dict:
    """The request body in the OpenAPI document (handlers parse the raw body themselves, for
    speed and for R7.2 errors), so clients and fuzzers see the real contract."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def create_app(state: ServerState):
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

    async def handle(endpoint: str, work) -> Response:
        try:
            response = await work()
            state.metrics.requests.labels(endpoint, "ok").inc()
            return response
        except (ApiError, PoolError) as exc:
            state.metrics.requests.labels(endpoint, exc.code).inc()
            return _error(exc)
        except ExchangeError as exc:
            state.metrics.requests.labels(endpoint, exc.code).inc()
            return _error(ApiError(exc.status, exc.code, exc.message))
        except RuntimeFault as exc:
            status, code = fault_status(exc)
            if status >= 500:
                log.warning("request_failed endpoint=%s code=%s error=%s", endpoint, code, exc)
            state.metrics.requests.labels(endpoint, code).inc()
            return _error(ApiError(status, code, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(error_body(code, str(exc.detail)), exc.status_code)

    @app.post("/v1/embeddings", openapi_extra=_body_schema(EmbeddingsBody))
    async def embeddings(request: Request) -> Response:
        async def work() -> Response:
            body = _parse(await _read_body(request, state.options.max_body_bytes),
                          EmbeddingsBody)
            dep = state.pool.deployment_for(body.model)
            texts = _texts(body.input)
            manifest = dep.info
            if (wrong := task_mismatch(manifest.name, manifest.task, "embeddings")) is not None:
                raise ApiError(422, "unsupported", wrong)
            if body.dimensions is not None and manifest.hidden_size is not None \
                    and body.dimensions != manifest.hidden_size:
                raise ApiError(422, "unsupported", f"dimensions must be {manifest.hidden_size} "
                               f"for {manifest.name!r}, got {body.dimensions}")
            vectors, tokens, headers = await _infer(dep, texts, body.truncate,
                                                    _deadline(request))
            if body.encoding_format == "base64":
                data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
            else:
                data = list(vectors)
            return _json({
                "object": "list", "model": manifest.name,
                "data": [{"object": "embedding", "index": i, "embedding": e}
                         for i, e in enumerate(data)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)
        return await handle("embeddings", work)

    @app.post("/v1/classify", openapi_extra=_body_schema(ClassifyBody))
    async def classify(request: Request) -> Response:
        async def work() -> Response:
            body = _parse(await _read_body(request, state.options.max_body_bytes), ClassifyBody)
            dep = state.pool.deployment_for(body.model)
            texts = _texts(body.input)
            manifest = dep.info
            if (wrong := task_mismatch(manifest.name, manifest.task, "classify")) is not None:
                raise ApiError(422, "unsupported", wrong)
            logits, tokens, headers = await _infer(dep, texts, body.truncate,
                                                   _deadline(request))
            if manifest.task is Task.TOKEN_CLASSIFY:  # entity spans per input (R7.4)
                data = await _off_loop(sum(len(t) for t in texts), entities_answer, manifest,
                                       texts, body.truncate, logits)
                return _json({"object": "list", "model": manifest.name, "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                             headers=headers)
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
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                         headers=headers)
        return await handle("classify", work)

    @app.post("/v1/rerank", openapi_extra=_body_schema(RerankBody))
    async def rerank(request: Request) -> Response:
        async def work() -> Response:
            body = _parse(await _read_body(request, state.options.max_body_bytes), RerankBody)
            dep = state.pool.deployment_for(body.model)
            try:
                pairs = rerank_pairs(body)
            except RerankInputError as exc:
                code = "too_large" if exc.status == 413 else "invalid_request"
                raise ApiError(exc.status, code, str(exc)) from None
            manifest = dep.info
            if (wrong := task_mismatch(manifest.name, manifest.task, "rerank")) is not None:
                raise ApiError(422, "unsupported", wrong)
            scores, tokens, headers = await _infer(dep, pairs, body.truncate,
                                                   _deadline(request), field="documents")
            return _json(rerank_answer(manifest.name, body, pairs, scores, tokens),
                         headers=headers)
        return await handle("rerank", work)

    @app.get("/v1/models")
    async def models() -> Response:
        data = []
        for dep in list(state.pool.deployments.values()):
            m = dep.info
            entry = {"id": m.name, "object": "model", "created": 0, "owned_by": "vllm-srun",
                     "deployment": dep.name, "revision": m.revision, "task": m.task.value,
                     "max_tokens": m.max_tokens,
                     "dimensions": m.hidden_size if m.task is Task.EMBED else None,
                     "backend": dep.config.backend or "onnxruntime",
                     "replicas": len(dep.replicas)}
            limits = [r.limits for r in dep.replicas if r.state == "ready" and r.limits]
            if limits and all(x == limits[0] for x in limits):
                entry.update(limits[0])  # what an attaching pool checks (R5.4)
            local = state.pool.local_replica()
            if local is not None and local in dep.replicas and local.runner is not None:
                entry["num_threads"] = local.runner.args.num_threads
            data.append(entry)
        return _json({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        ok, reason = state.ready()
        if not ok:
            return _json(error_body("not_ready", reason), 503)
        return _json({"status": "ok", "model": state.pool.deployment_for(None).info.name})

    @app.get("/v1/threads")
    async def threads() -> Response:
        local = state.pool.local_replica()
        if local is not None:
            return _json(await local.threads_report())
        out = {}
        for dep in list(state.pool.deployments.values()):
            reports = await asyncio.gather(*(r.threads_report() for r in dep.replicas))
            out[dep.name] = {r.id: rep for r, rep in zip(dep.replicas, reports, strict=True)}
        return _json({"deployments": out})

    @app.get("/v1/inventory")
    async def inventory() -> Response:
        return _json(state.pool.inventory())

    @app.get("/metrics")
    async def metrics() -> Response:
        local = state.pool.local_replica()
        if local is not None and local.runner is not None:
            state.metrics.cache_hits.set(local.runner.cache.hits)
        state.metrics.pool_snapshot(state.pool.inventory())
        state.ready()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    gated = AdmissionGate(app, state)
    if state.options.api_key:
        return RequireApiKey(gated, state.options.api_key)
    return gated
