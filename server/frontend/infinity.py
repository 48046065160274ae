"""infinity's routes where its shapes differ from ours (R7.5): an infinity client switches by
changing the URL.

``/embeddings`` (OpenAI's shape, no ``/v1``; ``dimensions: 0`` means all), ``/rerank`` with
``documents`` (``object: "rerank"``, each ``document`` a string; a body with ``texts`` is
text-embeddings-inference's, see ``tei.py``), ``/classify`` (every label per input, best
first; ``raw_scores``: logits) and ``/models``. As infinity (through sentence-transformers)
does, inputs over the model's limit are cut, not refused. ``model`` may be left out or be
infinity's ``"default/not-specified"``: the default deployment answers. Errors are R7.2's
``{"error": {"code", "message"}}``, the shape infinity's own errors take.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from vllm_srun.runtime.tasks import rerank_order
from vllm_srun.runtime.types import Task
from vllm_srun.server.frontend.errors import ApiError
from vllm_srun.server.frontend.options import (
    EmbedOptions,
    class_probabilities,
    raw_scores_wanted,
)
from vllm_srun.server.frontend.requests import M, parse, read_body, texts_of
from vllm_srun.server.frontend.routes import (
    answer,
    body_schema,
    check_task,
    embed,
    embedding_data,
    infer,
    json_response,
    usage,
)
from vllm_srun.server.frontend.tasks import rerank_pairs
from vllm_srun.server.pool.deployment_pool import DeploymentPool, listed_ids

router = APIRouter()
NOT_SPECIFIED = "default/not-specified"  # infinity's default ``model``
TRUNCATE = True  # sentence-transformers cuts inputs at the model's limit; infinity with it


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = NOT_SPECIFIED


class EmbeddingsBody(_Body):
    input: StrictStr | list[StrictStr]
    encoding_format: Literal["float", "base64"] = "float"
    user: StrictStr | None = None  # accepted, not used
    dimensions: StrictInt = 0  # 0: every dimension
    modality: Literal["text"] = "text"


class RerankBody(_Body):
    query: StrictStr
    documents: list[StrictStr]
    return_documents: StrictBool = False
    raw_scores: StrictBool = False
    top_n: StrictInt | None = Field(default=None, ge=1)


class ClassifyBody(_Body):
    input: list[StrictStr]
    raw_scores: StrictBool = False


def _deployment(request: Request, model: str) -> DeploymentPool:
    pool = request.app.state.server.pool
    return pool.deployment_for(None if model == NOT_SPECIFIED else model)


async def _read(request: Request, schema: type[M]) -> tuple[M, DeploymentPool]:
    body = parse(await read_body(request, request.app.state.server.options.max_body_bytes),
                 schema)
    return body, _deployment(request, body.model)


def _envelope(obj: str, dep: DeploymentPool, tokens: int) -> dict:
    return {"object": obj, "model": dep.info.name, "usage": usage(tokens),
            "id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


@router.post("/embeddings", openapi_extra=body_schema(EmbeddingsBody))
async def embeddings(request: Request) -> Response:
    async def work() -> Response:
        body, dep = await _read(request, EmbeddingsBody)
        texts = texts_of(body.input)
        vectors, tokens, headers = await embed(
            request, dep, texts, TRUNCATE, EmbedOptions(None, body.dimensions or None))
        return json_response({**_envelope("list", dep, tokens),
                              "data": embedding_data(vectors, body.encoding_format)},
                             headers=headers)
    return await answer(request, "embeddings", work)


def names_documents(raw: bytes) -> bool:
    """Whether a ``/rerank`` body is infinity's (``documents``) rather than TEI's."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and "documents" in data and "texts" not in data


async def rerank(request: Request, raw: bytes) -> Response:
    """``/rerank`` with ``documents`` (the route is ``tei.py``'s)."""
    async def work() -> Response:
        body = parse(raw, RerankBody)
        dep = _deployment(request, body.model)
        pairs = rerank_pairs(body.query, body.documents)
        check_task(dep.info, "rerank")
        scores, tokens, headers = await infer(request, dep, pairs, TRUNCATE, "documents",
                                              raw_scores_wanted(dep.info, body.raw_scores))
        flat = scores.reshape(len(pairs))
        results = []
        for i in rerank_order(flat, body.top_n):
            entry: dict = {"relevance_score": float(flat[i]), "index": i}
            if body.return_documents:
                entry["document"] = body.documents[i]
            results.append(entry)
        return json_response({**_envelope("rerank", dep, tokens), "results": results},
                             headers=headers)
    return await answer(request, "rerank", work)


@router.post("/classify", openapi_extra=body_schema(ClassifyBody))
async def classify(request: Request) -> Response:
    """Sequence classification: per input, every label with its score, best first."""
    async def work() -> Response:
        body, dep = await _read(request, ClassifyBody)
        texts = texts_of(body.input)
        check_task(dep.info, "classify")
        if dep.info.task is Task.TOKEN_CLASSIFY:
            raise ApiError("unsupported", f"model {dep.info.name!r} is a token classifier; "
                                          "use /v1/classify for its entity spans")
        logits, tokens, headers = await infer(request, dep, texts, TRUNCATE)
        scores = class_probabilities(logits, body.raw_scores)
        labels = dep.info.labels
        data = [[{"score": float(row[j]), "label": labels[j]}
                 for j in (-row).argsort(kind="stable")] for row in scores]
        return json_response({**_envelope("classify", dep, tokens), "data": data},
                             headers=headers)
    return await answer(request, "classify", work)


_CAPABILITIES = {Task.EMBED: ["embed"], Task.RERANK: ["rerank"], Task.CLASSIFY: ["classify"],
                 Task.TOKEN_CLASSIFY: []}


@router.get("/models")
async def models(request: Request) -> Response:
    """infinity's model list (``owned_by`` is infinity's constant, which its clients
    check)."""
    pool = request.app.state.server.pool
    data = [{"id": model_id, "object": "model", "owned_by": "infinity", "created": 0,
             "backend": dep.config.backend or "onnxruntime",
             "capabilities": _CAPABILITIES[dep.info.task],
             "stats": {"replicas": len(dep.replicas), "ready": len(dep.ready_ids())}}
            for dep in list(pool.deployments.values())
            for model_id in listed_ids(dep.config, dep.info)]
    return json_response({"object": "list", "data": data})
