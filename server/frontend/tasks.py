"""Request and answer shapes of the tasks beyond embeddings (R7.4): which endpoint serves
which task, entity spans of a token classifier on ``/v1/classify``, and reranking on
``/v1/rerank``. Workers return rows; the shaping happens here, in the front end.
"""

from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path

import numpy as np

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.tasks import entity_spans, rerank_order
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import Task
from vllm_srun.server.frontend.errors import ApiError
from vllm_srun.server.frontend.schemas import MAX_INPUTS, RerankBody

ENDPOINT_TASKS = {"embeddings": (Task.EMBED,), "classify": (Task.CLASSIFY, Task.TOKEN_CLASSIFY),
                  "rerank": (Task.RERANK,)}
_ENDPOINT_OF = {Task.EMBED: "/v1/embeddings", Task.CLASSIFY: "/v1/classify",
                Task.TOKEN_CLASSIFY: "/v1/classify", Task.RERANK: "/v1/rerank"}
_KIND = {Task.EMBED: "an embedder", Task.CLASSIFY: "a sequence classifier",
         Task.TOKEN_CLASSIFY: "a token classifier", Task.RERANK: "a reranker (cross-encoder)"}


def task_mismatch(model: str, task: Task, endpoint: str) -> str | None:
    """Why ``endpoint`` cannot serve a model of ``task`` (the 422 message), or None."""
    if task in ENDPOINT_TASKS[endpoint]:
        return None
    return f"model {model!r} is {_KIND[task]}; use {_ENDPOINT_OF[task]}"


def rerank_pairs(query: str, documents: list, field: str = "documents") -> list[tuple[str, str]]:
    """One (query, document) row per document (a string or ``{"text"}``), validated; errors
    name the field (``documents``, or text-embeddings-inference's ``texts``)."""
    if not query:
        raise ApiError("invalid_request", "query must not be an empty string")
    if not documents:
        raise ApiError("invalid_request", f"{field} must not be an empty list")
    if len(documents) > MAX_INPUTS:
        raise ApiError("too_large", f"{field} has {len(documents)} items; limit {MAX_INPUTS}")
    texts = [d if isinstance(d, str) else d.text for d in documents]
    for i, t in enumerate(texts):
        if not t:
            raise ApiError("invalid_request", f"{field}[{i}] is an empty string")
    return [(query, t) for t in texts]


def rerank_answer(model: str, body: RerankBody, pairs: list[tuple[str, str]],
                  scores: np.ndarray, tokens: int) -> dict:
    """Cohere's / Jina's answer: ``results`` of ``index`` and ``relevance_score``, best
    first, at most ``top_n``, each with ``document`` when ``return_documents``."""
    flat = scores.reshape(len(pairs))
    results = []
    for i in rerank_order(flat, body.top_n):
        entry: dict = {"index": i, "relevance_score": float(flat[i])}
        if body.return_documents:
            entry["document"] = {"text": pairs[i][1]}
        results.append(entry)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": model,
            "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@functools.lru_cache(maxsize=16)
def front_tokenizer(artifact: str, hub_revision: str | None,
                    revision: str | None) -> tuple[Tokenizer, int | None]:
    """The deployment's tokenizer (offsets, special-token mask, decoder) and unknown-token
    id, loaded once per artifact revision in the front end."""
    manifest = resolve(artifact, hub_revision)
    tokenizer = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
    config_path = Path(manifest.tokenizer_path).with_name("tokenizer_config.json")
    unk = None
    if config_path.is_file():
        unk = json.loads(config_path.read_text()).get("unk_token")
    if isinstance(unk, dict):  # an AddedToken written out
        unk = unk.get("content")
    candidates = [unk] if isinstance(unk, str) else ["[UNK]", "<unk>"]
    unk_id = next((i for c in candidates if (i := tokenizer.token_to_id(c)) is not None), None)
    return tokenizer, unk_id


def entities_answer(info, texts: list[str], truncate: bool, logits: np.ndarray) -> list[dict]:
    """Per input, its entity spans from the worker's per-token logits [rows, tokens, labels].
    The front end tokenizes again (same tokenizer, same truncation) for character offsets."""
    tokenizer, unk_id = front_tokenizer(info.artifact, info.hub_revision, info.revision)
    encodings = tokenizer.encodings(texts, truncate)
    data = []
    for i, (text, enc) in enumerate(zip(texts, encodings, strict=True)):
        spans = entity_spans(text, enc, logits[i], info.labels, unk_id,
                             tokenizer.tokens_to_string)
        data.append({"index": i, "entities": [
            {"entity_group": s.entity_group, "score": s.score, "word": s.word,
             "start": s.start, "end": s.end} for s in spans]})
    return data
