"""R7.5: an infinity client switches by changing the URL (infinity's routes have no ``/v1``).

Real ``vllm-srun serve`` processes over loopback (all-MiniLM-L6-v2, the tiny cross-encoder,
the tiny classifier). Answers are validated against infinity's OpenAPI document (version
0.0.77, in tests/data/) and equal our ``/v1`` routes' answers.
"""

from __future__ import annotations

import base64

import numpy as np

from tests import openapi_check
from tests.conftest import L6

INF = "infinity_openapi.json"
TEXTS = ["What is Deep Learning?", "Zürich und München 漢字 🚀"]


def valid(response, path: str, method: str = "post") -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    openapi_check.validate(INF, openapi_check.response_schema(INF, path, method, "200"), body)
    return body


def test_embeddings_answer_infinitys_shape_with_v1s_vectors(l6_server):
    """/embeddings: OpenAI's shape plus ``id`` and ``created``; the vectors equal
    /v1/embeddings'; ``model`` may be infinity's default; ``dimensions: 0`` means all;
    base64 is little-endian float32; inputs over the limit are cut, as infinity cuts them."""
    c = l6_server.client
    request = {"input": TEXTS, "model": "default/not-specified", "modality": "text"}
    openapi_check.validate(INF, "_OpenAIEmbeddingInput_Text", request)
    body = valid(c.post("/embeddings", json=request), "/embeddings")
    ours = c.post("/v1/embeddings", json={"input": TEXTS}).json()
    assert [d["embedding"] for d in body["data"]] == [d["embedding"] for d in ours["data"]]
    assert body["model"] == L6 and body["id"].startswith("infinity-")
    assert body["usage"] == ours["usage"]
    zero = c.post("/embeddings", json={"input": TEXTS[0], "dimensions": 0}).json()
    assert zero["data"][0]["embedding"] == ours["data"][0]["embedding"]
    cut = valid(c.post("/embeddings", json={"input": TEXTS[0], "dimensions": 32,
                                            "encoding_format": "base64", "user": "u"}),
                "/embeddings")
    vec = np.frombuffer(base64.b64decode(cut["data"][0]["embedding"]), "<f4")
    full = np.array(ours["data"][0]["embedding"], dtype=np.float32)[:32]
    assert np.abs(vec - full / np.linalg.norm(full)).max() < 1e-6
    long = c.post("/embeddings", json={"input": "hello " * 300})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 256
    r = c.post("/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.post("/embeddings", json={"input": "x", "modality": "image"})
    assert r.status_code == 400 and "modality" in r.json()["error"]["message"]
    r = c.post("/embeddings", json={"input": "x", "normalize": False})
    assert r.status_code == 400 and "'normalize'" in r.json()["error"]["message"]


def test_rerank_with_documents_answers_infinitys_shape(cross_encoder_server):
    """/rerank with ``documents``: ``object: "rerank"``, results best first with the scores
    of /v1/rerank, ``document`` a string, ``top_n``; ``raw_scores`` the logits (as TEI's
    /rerank answers them)."""
    c = cross_encoder_server.client
    query, docs = "where does Maria live?", ["Maria lives in Berlin.", "a", "cats"]
    request = {"query": query, "documents": docs, "return_documents": True, "top_n": 2}
    openapi_check.validate(INF, "RerankInput", request)
    body = valid(c.post("/rerank", json=request), "/rerank")
    ours = c.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()
    assert body["object"] == "rerank"
    assert [(r["index"], r["relevance_score"], r["document"]) for r in body["results"]] == \
        [(r["index"], r["relevance_score"], docs[r["index"]]) for r in ours["results"]]
    raw = valid(c.post("/rerank", json={"query": query, "documents": docs,
                                        "raw_scores": True}), "/rerank")
    tei = c.post("/rerank", json={"query": query, "texts": docs, "raw_scores": True}).json()
    assert [(r["index"], r["relevance_score"]) for r in raw["results"]] == \
        [(r["index"], r["score"]) for r in tei]
    r = c.post("/rerank", json={"query": query, "documents": [{"text": "a"}]})
    assert r.status_code == 400 and "documents" in r.json()["error"]["message"]


def test_classify_answers_every_label_best_first(classifier_server):
    """/classify: per input every label with its /v1/classify score, best first;
    ``raw_scores`` the logits."""
    c = classifier_server.client
    request = {"input": TEXTS, "raw_scores": False}
    openapi_check.validate(INF, "ClassifyInput", request)
    body = valid(c.post("/classify", json=request), "/classify")
    ours = c.post("/v1/classify", json={"input": TEXTS}).json()["data"]
    assert body["object"] == "classify"
    assert body["data"] == [[{"score": s["score"], "label": s["label"]} for s in o["scores"]]
                            for o in ours]
    raw = valid(c.post("/classify", json={"input": TEXTS, "raw_scores": True}), "/classify")
    v1_raw = c.post("/v1/classify", json={"input": TEXTS, "raw_scores": True}).json()["data"]
    assert raw["data"][0] == [{"score": s["score"], "label": s["label"]}
                              for s in v1_raw[0]["scores"]]
    r = c.post("/classify", json={"input": "not a list"})
    assert r.status_code == 400 and "input" in r.json()["error"]["message"]


def test_models_lists_each_deployment_in_infinitys_shape(l6_server, cross_encoder_server):
    """/models: infinity's OpenAIModelInfo, with each model's capability."""
    for server, capability in ((l6_server, "embed"), (cross_encoder_server, "rerank")):
        body = valid(server.client.get("/models"), "/models", "get")
        assert [m["capabilities"] for m in body["data"]] == [[capability]]
    assert body["data"][0]["id"] == server.client.get("/v1/models").json()["data"][0]["id"]
