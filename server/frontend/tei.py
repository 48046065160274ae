"""text-embeddings-inference's routes (R7.5): a TEI client switches by changing the URL.

``/embed``, ``/rerank`` (``texts``), ``/predict``, ``/similarity``, ``/tokenize``,
``/decode`` and ``/info`` with TEI's request and answer shapes (its OpenAPI document, version
1.9.3). Requests carry no ``model``: they go to the default deployment (the
``system.decision_model`` binding, else the only one). Each goes through the same request
path as ``/v1`` (``routes.py``), so a vector or score equals the ``/v1`` route's. Errors keep
the R7.2 status and code, in TEI's body: ``{"error": message, "error_type": ..., "code"}``,
but for a model that cannot give a route's output, answered as TEI answers it (424,
``Backend``): a model of another task (``/predict`` on an embedder), and ``/embed_all``
(per-token vectors) and ``/embed_sparse`` (SPLADE) once their request is checked: the
workers pool inside the forward, and no model here has SPLADE pooling (an MLM head).
"""

from __future__ import annotations

import asyncio
import importlib.metadata

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from vllm_srun.runtime.tasks import rerank_order
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import Task, TextInput
from vllm_srun.server.frontend import infinity
from vllm_srun.server.frontend.errors import ApiError, HttpError
from vllm_srun.server.frontend.options import (
    EmbedOptions,
    check_direction,
    class_probabilities,
    prompt_of,
    raw_scores_wanted,
    with_prompt,
)
from vllm_srun.server.frontend.requests import parse, read_body, texts_of
from vllm_srun.server.frontend.routes import (
    answer,
    body_schema,
    embed,
    infer,
    json_response,
    off_loop,
    read,
)
from vllm_srun.server.frontend.schemas import MAX_INPUTS, Direction
from vllm_srun.server.frontend.tasks import front_tokenizer, rerank_pairs
from vllm_srun.server.pool.deployment_pool import DeploymentPool, ModelInfo
from vllm_srun.server.pool.dispatch import MAX_IN_FLIGHT
from vllm_srun.server.pool.errors import PoolError

router = APIRouter()

# TEI's ErrorType for each R7.2 code (anything the request got wrong is "Validation")
_ERROR_TYPE = {"overloaded": "Overloaded", "not_ready": "Unhealthy", "not_available": "Backend",
               "replica_failed": "Unhealthy", "replica_unavailable": "Unhealthy",
               "replica_unauthorized": "Unhealthy", "replica_error": "Backend",
               "internal_error": "Backend", "deadline_exceeded": "Backend"}


def tei_error(err: HttpError) -> dict:
    """TEI's ErrorResponse, with the R7.2 ``code`` beside it."""
    return {"error": err.message, "error_type": _ERROR_TYPE.get(err.code, "Validation"),
            "code": err.code}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedBody(_Body):
    inputs: StrictStr | list[StrictStr | list[StrictInt]]
    normalize: StrictBool = True
    truncate: StrictBool | None = None  # None: the server's default (no truncation)
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None
    dimensions: StrictInt | None = None


class UnpooledBody(_Body):
    """TEI's EmbedAllRequest and EmbedSparseRequest."""

    inputs: StrictStr | list[StrictStr | list[StrictInt]]
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class RerankBody(_Body):
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"


class PredictBody(_Body):
    inputs: StrictStr | list[StrictStr] | list[list[StrictStr]]
    raw_scores: StrictBool = False
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"


class SimilarityInput(_Body):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Body):
    prompt_name: StrictStr | None = None
    truncate: StrictBool | None = None
    truncation_direction: Direction = "right"


class SimilarityBody(_Body):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class TokenizeBody(_Body):
    inputs: StrictStr | list[StrictStr]
    add_special_tokens: StrictBool = True
    prompt_name: StrictStr | None = None


class DecodeBody(_Body):
    ids: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: StrictBool = True


@router.post("/embed", openapi_extra=body_schema(EmbedBody))
async def embed_route(request: Request) -> Response:
    async def work() -> Response:
        body, dep = await read(request, EmbedBody)
        texts = texts_of(body.inputs, "inputs")
        _check_task(dep.info, (Task.EMBED,), "/embed")
        truncate = bool(body.truncate)
        check_direction(body.truncation_direction, truncate)
        vectors, _, headers = await embed(
            request, dep, texts, truncate,
            EmbedOptions(body.normalize, body.dimensions, body.prompt_name), "inputs")
        return json_response(vectors, headers=headers)
    return await answer(request, "embed", work, tei_error)


def _not_available(route: str, info: ModelInfo) -> ApiError:
    """TEI's answer (424, ``Backend``) where the model cannot give ``route``'s output."""
    if info.task is not Task.EMBED:
        why = f"model {info.name!r} is not an embedding model ({info.task.value})"
    elif route == "/embed_sparse":
        why = (f"model {info.name!r} is not an embedding model with SPLADE pooling (no "
               f"masked-language-model head is loaded); use /embed")
    else:
        why = (f"per-token vectors are not available for model {info.name!r}: its workers "
               f"answer pooled vectors only; use /embed")
    return ApiError("not_available", f"{route}: {why}")


def _unpooled_route(route: str) -> None:
    """Add ``route`` (``/embed_all`` or ``/embed_sparse``): one handler for both, which checks
    TEI's request, then answers that the model cannot give the output."""
    async def handler(request: Request) -> Response:
        async def work() -> Response:
            body, dep = await read(request, UnpooledBody)
            texts_of(body.inputs, "inputs")
            raise _not_available(route, dep.info)
        return await answer(request, route[1:], work, tei_error)
    router.add_api_route(route, handler, methods=["POST"], name=route[1:],
                         openapi_extra=body_schema(UnpooledBody))


for _route in ("/embed_all", "/embed_sparse"):
    _unpooled_route(_route)


@router.post("/similarity", openapi_extra=body_schema(SimilarityBody))
async def similarity(request: Request) -> Response:
    """Cosine similarity of ``source_sentence`` to each of ``sentences`` (normalized
    vectors, their dot products)."""
    async def work() -> Response:
        body, dep = await read(request, SimilarityBody)
        params = body.parameters or SimilarityParameters()
        sentences = texts_of(body.inputs.sentences, "inputs.sentences")
        if not body.inputs.source_sentence:
            raise ApiError("invalid_request", "inputs.source_sentence is an empty string")
        _check_task(dep.info, (Task.EMBED,), "/similarity")
        truncate = bool(params.truncate)
        check_direction(params.truncation_direction, truncate)
        vectors, _, headers = await embed(
            request, dep, [body.inputs.source_sentence, *sentences], truncate,
            EmbedOptions(True, None, params.prompt_name), "inputs")
        return json_response(vectors[1:] @ vectors[0], headers=headers)
    return await answer(request, "similarity", work, tei_error)


@router.post("/rerank", openapi_extra=body_schema(RerankBody))
async def rerank(request: Request) -> Response:
    """TEI's rerank (``texts``); a body with ``documents`` is infinity's (and Cohere's)."""
    server = request.app.state.server
    try:
        raw = await read_body(request, server.options.max_body_bytes)
    except ApiError as exc:
        return await answer(request, "rerank", _raise(exc), tei_error)
    if infinity.names_documents(raw):
        return await infinity.rerank(request, raw)

    async def work() -> Response:
        body = parse(raw, RerankBody)
        dep = server.pool.deployment_for(None)
        pairs = rerank_pairs(body.query, body.texts, "texts")
        _check_task(dep.info, (Task.RERANK,), "/rerank")
        truncate = bool(body.truncate)
        check_direction(body.truncation_direction, truncate)
        scores, _, headers = await infer(request, dep, pairs, truncate, "texts",
                                         raw_scores_wanted(dep.info, body.raw_scores))
        flat = scores.reshape(len(pairs))
        ranks = []
        for i in rerank_order(flat, None):
            rank: dict = {"index": i, "score": float(flat[i])}
            if body.return_text:
                rank["text"] = body.texts[i]
            ranks.append(rank)
        return json_response(ranks, headers=headers)
    return await answer(request, "rerank", work, tei_error)


def _raise(exc: Exception):
    async def work() -> Response:
        raise exc
    return work


def _check_task(info: ModelInfo, tasks: tuple[Task, ...], route: str) -> None:
    """A model of another task: 424 ``Backend``, as TEI's router answers a model of the wrong
    type ("model is not a re-ranker model"); the message names the route that serves it."""
    if info.task not in tasks:
        use = {Task.EMBED: "/embed", Task.CLASSIFY: "/predict", Task.RERANK: "/rerank",
               Task.TOKEN_CLASSIFY: "/v1/classify"}[info.task]
        raise ApiError("not_available", f"{route} cannot serve model {info.name!r} "
                                        f"({info.task.value}); use {use}")


def predict_inputs(inputs: str | list) -> tuple[list[TextInput], bool]:
    """TEI's PredictInput: a string, a pair of strings, or a batch of one- or two-string
    lists. Returns the rows and whether the request was a batch."""
    if isinstance(inputs, str):
        if not inputs:
            raise ApiError("invalid_request", "inputs is an empty string")
        return [inputs], False
    if inputs and all(isinstance(x, str) for x in inputs):
        if len(inputs) != 2 or not all(inputs):
            raise ApiError("invalid_request", "inputs: a list of strings is one pair of 2 "
                                              "non-empty strings; send a batch as a list of "
                                              "lists")
        return [(inputs[0], inputs[1])], False
    if not inputs:
        raise ApiError("invalid_request", "inputs must not be an empty list")
    if len(inputs) > MAX_INPUTS:
        raise ApiError("too_large", f"inputs has {len(inputs)} items; limit {MAX_INPUTS}")
    rows: list[TextInput] = []
    for i, item in enumerate(inputs):
        if len(item) not in (1, 2) or not all(item):
            raise ApiError("invalid_request", f"inputs[{i}] must be 1 or 2 non-empty strings")
        rows.append(item[0] if len(item) == 1 else (item[0], item[1]))
    return rows, True


@router.post("/predict", openapi_extra=body_schema(PredictBody))
async def predict(request: Request) -> Response:
    """Sequence classification (every label, best first), or a cross-encoder's score."""
    async def work() -> Response:
        body, dep = await read(request, PredictBody)
        rows, batch = predict_inputs(body.inputs)
        _check_task(dep.info, (Task.CLASSIFY, Task.RERANK), "/predict")
        truncate = bool(body.truncate)
        check_direction(body.truncation_direction, truncate)
        rerank = dep.info.task is Task.RERANK
        raw = rerank and raw_scores_wanted(dep.info, body.raw_scores)
        out, _, headers = await infer(request, dep, rows, truncate, "inputs", raw)
        if rerank:  # one label: the score as /rerank answers it
            data = [[{"label": "LABEL_0", "score": float(row[0])}] for row in out]
        else:
            data = _predictions(class_probabilities(out, body.raw_scores), dep.info.labels)
        return json_response(data if batch else data[0], headers=headers)
    return await answer(request, "predict", work, tei_error)


def _predictions(scores: np.ndarray, labels: tuple[str, ...]) -> list[list[dict]]:
    return [[{"label": labels[j], "score": float(row[j])}
             for j in np.argsort(-row, kind="stable")] for row in scores]


async def _tokenizer(info: ModelInfo) -> Tokenizer:
    """The deployment's tokenizer in the front end (loaded once per revision, off the
    event loop)."""
    if info.manifest is None:
        raise ApiError("unsupported", f"deployment of {info.name!r} is served by attached "
                                      "endpoints only: its tokenizer is not here")
    tokenizer, _ = await asyncio.to_thread(front_tokenizer, info.artifact, info.hub_revision,
                                          info.revision)
    return tokenizer


def simple_tokens(text: str, encoding) -> list[dict]:
    """TEI's SimpleToken per token: special tokens by their token text, the others by the
    text they cover, with ``start``/``stop`` as UTF-8 byte offsets (TEI's)."""
    data = text.encode()
    to_byte = np.cumsum([0, *(len(c.encode()) for c in text)]).tolist()
    out = []
    for tid, special, (start, stop), token in zip(
            encoding.ids, encoding.special_tokens_mask, encoding.offsets, encoding.tokens,
            strict=True):
        if special:
            out.append({"id": tid, "text": token, "special": True, "start": None,
                        "stop": None})
        else:
            b0, b1 = to_byte[start], to_byte[stop]
            out.append({"id": tid, "text": data[b0:b1].decode(errors="replace"),
                        "special": False, "start": b0, "stop": b1})
    return out


@router.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
async def tokenize(request: Request) -> Response:
    """Tokens as the model sees them (with its prompt, when it has one)."""
    async def work() -> Response:
        body, dep = await read(request, TokenizeBody)
        texts = texts_of(body.inputs, "inputs")
        texts = with_prompt(texts, prompt_of(dep.info, body.prompt_name))
        tokenizer = await _tokenizer(dep.info)
        encodings = await off_loop(sum(map(len, texts)), tokenizer.plain, texts,
                                   body.add_special_tokens)
        return json_response([simple_tokens(t, e) for t, e in zip(texts, encodings,
                                                                    strict=True)])
    return await answer(request, "tokenize", work, tei_error)


@router.post("/decode", openapi_extra=body_schema(DecodeBody))
async def decode(request: Request) -> Response:
    async def work() -> Response:
        body, dep = await read(request, DecodeBody)
        seqs = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
        if not body.ids or not all(seqs):
            raise ApiError("invalid_request", "ids must not be empty")
        if len(seqs) > MAX_INPUTS:
            raise ApiError("too_large", f"ids has {len(seqs)} sequences; limit {MAX_INPUTS}")
        tokenizer = await _tokenizer(dep.info)
        vocab = tokenizer.vocab_size
        for i, seq in enumerate(seqs):
            bad = next((t for t in seq if not 0 <= t < vocab), None)
            if bad is not None:
                where = f"ids[{i}]" if seqs is body.ids else "ids"
                raise ApiError("invalid_request", f"{where} holds {bad}, not a token id of "
                                                  f"{dep.info.name!r} (0 to {vocab - 1})")
        return json_response(tokenizer.decode(seqs, body.skip_special_tokens))
    return await answer(request, "decode", work, tei_error)


def model_type(info: ModelInfo) -> dict:
    if info.task is Task.EMBED:
        pooling = info.manifest.pooling.value if info.manifest is not None else "mean"
        return {"embedding": {"pooling": pooling}}
    labels = info.labels if info.task is not Task.RERANK else ("LABEL_0",)
    head = {"id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)}}
    return {"reranker" if info.task is Task.RERANK else "classifier": head}


def _limit(dep: DeploymentPool, key: str) -> int | None:
    """The smallest of the ready replicas' batch limits (calibrated or configured)."""
    values = [r.limits[key] for r in dep.replicas
              if r.state == "ready" and r.limits and key in r.limits]
    return min(values) if values else getattr(dep.config.engine, key)


def info_body(dep: DeploymentPool) -> dict:
    m = dep.info
    return {"model_id": dep.config.artifact, "model_sha": m.revision, "model_dtype": "float32",
            "served_model_name": m.name, "model_type": model_type(m),
            "max_concurrent_requests": MAX_IN_FLIGHT * len(dep.replicas),
            "max_input_length": m.max_tokens or 0,
            "max_batch_tokens": _limit(dep, "max_num_batched_tokens") or m.max_tokens or 0,
            "max_batch_requests": _limit(dep, "max_num_seqs"),
            "max_client_batch_size": MAX_INPUTS,
            "auto_truncate": False, "tokenization_workers": len(dep.replicas),
            "version": importlib.metadata.version("vllm-srun")}


@router.get("/info")
async def info(request: Request) -> Response:
    """The default deployment, as TEI describes its model."""
    try:
        dep = request.app.state.server.pool.deployment_for(None)
    except PoolError as exc:
        return await answer(request, "info", _raise(exc), tei_error)
    return json_response(info_body(dep))
