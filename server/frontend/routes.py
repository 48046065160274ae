"""The public HTTP API (R7.1, R7.4): one handler per route. Each inference handler reads the
request (``requests.py``), dispatches through the pool and shapes the answer; every error
answer comes from the one table in ``errors.py``."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import EngineArgs, Task, TextInput
from vllm_srun.server.frontend.errors import REPLICA_HEADER, ApiError, HttpError, http_error
from vllm_srun.server.frontend.options import (
    EmbedOptions,
    apply_plan,
    check_direction,
    class_probabilities,
    prompt_of,
    raw_scores_wanted,
    vector_plan,
    with_prompt,
)
from vllm_srun.server.frontend.requests import (
    M,
    caller_deadline,
    parse,
    read_body,
    texts_of,
)
from vllm_srun.server.frontend.schemas import ClassifyBody, EmbeddingsBody, RerankBody
from vllm_srun.server.frontend.tasks import (
    entities_answer,
    rerank_answer,
    rerank_pairs,
    task_mismatch,
)
from vllm_srun.server.pool.deployment_pool import DeploymentPool, ModelInfo, listed_ids
from vllm_srun.server.pool.errors import ExchangeError, PoolError
from vllm_srun.server.worker.bridge import OFFLOAD_CHARS
from vllm_srun.server.worker.protocol import error_body
from vllm_srun.server.worker.trace import current as current_trace
from vllm_srun.tuner.report import document, labelled

log = logging.getLogger(__name__)
router = APIRouter()


def json_response(payload: object, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), status,
                    headers=headers, media_type="application/json")


def body_schema(model: type[BaseModel]) -> dict:
    """The request body in the OpenAPI document (handlers parse the raw body themselves, for
    speed and for R7.2 errors), so clients and fuzzers see the real contract."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def r7_error(err: HttpError) -> dict:
    """The R7.2 error body."""
    return error_body(err.code, err.message)


async def answer(request: Request, endpoint: str, work: Callable[[], Awaitable[Response]],
                 shape: Callable[[HttpError], dict] = r7_error) -> Response:
    """Run one inference handler's work; count its outcome; turn errors into answers (the
    body as ``shape`` writes it: a peer's routes answer in the peer's error shape)."""
    metrics = request.app.state.server.metrics
    try:
        response = await work()
    except (ApiError, PoolError, ExchangeError, RuntimeFault) as exc:
        err = http_error(exc)
        if err.status >= 500 and isinstance(exc, RuntimeFault):
            trace = current_trace()
            log.warning("request_failed endpoint=%s code=%s request_id=%s error=%s", endpoint,
                        err.code, trace.request_id if trace else "-", exc)
        metrics.requests.labels(endpoint, err.code).inc()
        return json_response(shape(err), err.status, err.headers)
    metrics.requests.labels(endpoint, "ok").inc()
    return response


async def infer(request: Request, dep: DeploymentPool, texts: list[TextInput], truncate: bool,
                field: str = "input", raw: bool = False) -> tuple[np.ndarray, int, dict[str, str]]:
    """Dispatch; rows, prompt tokens and the header naming the replica that answered.
    ``texts`` may hold (query, document) pairs; ``field`` names them in errors; ``raw`` asks
    for the rows before the model's last step (Normalize, a CrossEncoder's sigmoid)."""
    out, tokens, replica = await dep.infer(texts, truncate, caller_deadline(request), field,
                                           raw)
    return out, tokens, {REPLICA_HEADER: replica}


async def off_loop(chars: int, fn, *args):
    """``fn(*args)``; off the event loop when the input is big enough to tokenize slowly."""
    if chars > OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def read(request: Request, schema: type[M]) -> tuple[M, DeploymentPool]:
    """The request's body, parsed against ``schema``, and the deployment it names."""
    server = request.app.state.server
    body = parse(await read_body(request, server.options.max_body_bytes), schema)
    return body, server.pool.deployment_for(getattr(body, "model", None))


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def check_task(info: ModelInfo, endpoint: str) -> None:
    if (wrong := task_mismatch(info.name, info.task, endpoint)) is not None:
        raise ApiError("unsupported", wrong)


async def embed(request: Request, dep: DeploymentPool, texts: list[str], truncate: bool,
                options: EmbedOptions, field: str = "input") -> tuple[np.ndarray, int, dict]:
    """The request path of every embeddings route (ours, text-embeddings-inference's,
    infinity's): the model's prompt before each input, then the vectors as ``options``
    ask (normalization, Matryoshka dimensions)."""
    check_task(dep.info, "embeddings")
    plan = vector_plan(dep.info, options)
    texts = with_prompt(texts, prompt_of(dep.info, options.prompt_name))
    vectors, tokens, headers = await infer(request, dep, texts, truncate, field, plan.raw)
    return apply_plan(vectors, plan), tokens, headers


def embedding_data(vectors: np.ndarray, encoding_format: str) -> list[dict]:
    """OpenAI's ``data``: base64 is the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        items: list = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    else:
        items = list(vectors)
    return [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)]


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingsBody))
async def embeddings(request: Request) -> Response:
    async def work() -> Response:
        body, dep = await read(request, EmbeddingsBody)
        texts = texts_of(body.input)
        check_direction(body.truncation_direction, body.truncate)
        vectors, tokens, headers = await embed(
            request, dep, texts, body.truncate,
            EmbedOptions(body.normalize, body.dimensions, body.prompt_name))
        return json_response({"object": "list", "model": dep.info.name,
                              "data": embedding_data(vectors, body.encoding_format),
                              "usage": usage(tokens)}, headers=headers)
    return await answer(request, "embeddings", work)


def class_scores(logits: np.ndarray, labels: tuple[str, ...], top_k: int | None,
                 raw_scores: bool = False) -> list[dict]:
    """Softmax over each row's logits (``raw_scores``: the logits): the best label and the
    top-k scores, best first."""
    probs = class_probabilities(logits, raw_scores)
    k = min(top_k or len(labels), len(labels))
    out = []
    for i, p in enumerate(probs):
        order = np.argsort(-p, kind="stable")[:k]
        out.append({"index": i, "label": labels[order[0]], "score": float(p[order[0]]),
                    "scores": [{"label": labels[j], "score": float(p[j])} for j in order]})
    return out


@router.post("/v1/classify", openapi_extra=body_schema(ClassifyBody))
async def classify(request: Request) -> Response:
    async def work() -> Response:
        body, dep = await read(request, ClassifyBody)
        texts = texts_of(body.input)
        check_task(dep.info, "classify")
        check_direction(body.truncation_direction, body.truncate)
        if body.raw_scores and dep.info.task is Task.TOKEN_CLASSIFY:
            raise ApiError("unsupported", "raw_scores: entity spans of a token classifier are "
                                          "scored by probability; leave it out")
        logits, tokens, headers = await infer(request, dep, texts, body.truncate)
        if dep.info.task is Task.TOKEN_CLASSIFY:  # entity spans per input (R7.4)
            data = await off_loop(sum(len(t) for t in texts), entities_answer, dep.info,
                                  texts, body.truncate, logits)
        else:
            data = class_scores(logits, dep.info.labels, body.top_k, body.raw_scores)
        return json_response({"object": "list", "model": dep.info.name, "data": data,
                              "usage": usage(tokens)}, headers=headers)
    return await answer(request, "classify", work)


@router.post("/v1/rerank", openapi_extra=body_schema(RerankBody))
async def rerank(request: Request) -> Response:
    """Cross-encoder reranking (R7.4): each (query, document) pair is a row; the pairs of one
    request go to one replica as one unit."""
    async def work() -> Response:
        body, dep = await read(request, RerankBody)
        pairs = rerank_pairs(body.query, body.documents)
        check_task(dep.info, "rerank")
        check_direction(body.truncation_direction, body.truncate)
        scores, tokens, headers = await infer(request, dep, pairs, body.truncate, "documents",
                                              raw_scores_wanted(dep.info, body.raw_scores))
        return json_response(rerank_answer(dep.info.name, body, pairs, scores, tokens),
                             headers=headers)
    return await answer(request, "rerank", work)


def model_entry(dep: DeploymentPool, local: EngineArgs | None, model_id: str) -> dict:
    """``local``: the engine arguments of the deployment's in-process worker, if it has one."""
    m = dep.info
    entry = {"id": model_id, "object": "model", "created": 0, "owned_by": "vllm-srun",
             "deployment": dep.name, "revision": m.revision, "task": m.task.value,
             "max_tokens": m.max_tokens,
             "dimensions": m.hidden_size if m.task is Task.EMBED else None,
             "backend": dep.config.backend or "onnxruntime", "replicas": len(dep.replicas),
             **dep.precision()}
    limits = [r.limits for r in dep.replicas if r.state == "ready" and r.limits]
    if limits and all(x == limits[0] for x in limits):
        entry.update(limits[0])  # what an attaching pool checks (R5.4)
    if local is not None:
        entry["num_threads"] = local.num_threads
        entry["concurrent_forwards"] = local.concurrent_forwards
    return entry


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """One entry per served id: a deployment with several served names is listed under each
    (as vLLM lists them)."""
    pool = request.app.state.server.pool
    local = pool.local_replica()
    data = [model_entry(dep, local.runner.args if local is not None
                        and local in dep.replicas and local.runner is not None else None,
                        model_id)
            for dep in list(pool.deployments.values())
            for model_id in listed_ids(dep.config, dep.info)]
    return json_response({"object": "list", "data": data})


@router.get("/health")
async def health(request: Request) -> Response:
    server = request.app.state.server
    ok, reason = server.ready()
    if not ok:
        return json_response(error_body("not_ready", reason), 503)
    return json_response({"status": "ok", "model": server.pool.deployment_for(None).info.name})


@router.get("/v1/threads")
async def threads(request: Request) -> Response:
    """One report per replica, in the document ``vllm-srun threads report --json`` prints."""
    out = []
    for dep in list(request.app.state.server.pool.deployments.values()):
        reports = await asyncio.gather(*(r.threads_report() for r in dep.replicas))
        out += [labelled(rep, dep.name, r.id)
                for r, rep in zip(dep.replicas, reports, strict=True)]
    return json_response(document(out, "server"))


@router.get("/v1/inventory")
async def inventory(request: Request) -> Response:
    return json_response(request.app.state.server.pool.inventory())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The front end's metrics and every worker's forward metrics, labelled by replica."""
    server = request.app.state.server
    server.metrics.pool_snapshot(server.pool.inventory())
    server.ready()
    texts = await asyncio.gather(*(r.metrics_text() for r in server.pool.replicas()))
    return Response(server.metrics.render(t for t in texts if t),
                    media_type=CONTENT_TYPE_LATEST)
