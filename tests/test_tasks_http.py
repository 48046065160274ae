"""R7.4 end to end over real HTTP, by real ``vllm-srun serve`` processes, on tiny real
weights: ``/v1/rerank`` (Cohere/Jina shape) on a cross-encoder served in process, and a
config of managed worker processes serving a token classifier (entity spans on
``/v1/classify``), a cross-encoder (text pairs over the worker wire), a ModernBERT embedder
with a 4,096-token input and an XLM-RoBERTa embedder. Answers equal the reference
libraries'; bad input gets its R7.2 error naming the field; ``/v1/models`` reports each
model's task.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from tests.conftest import Server, assert_same_spans

QUERY = "where does Maria live?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Maria lives in Berlin.",
             "Zürich und München", "Berlin is the capital of Germany " * 6, "a"]
NER_TEXTS = ["Maria lives in Berlin and São Paulo, which is unaffordable.", "hello"]


@pytest.fixture(scope="module")
def rerank_server(cross_encoder_server):
    return cross_encoder_server  # one server of the cross-encoder per test session


@pytest.fixture(scope="module")
def expected_scores(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(cross_encoder_dir), device="cpu")
    return model.predict([(QUERY, d) for d in DOCUMENTS])


def error_of(response) -> tuple[int, str, str]:
    err = response.json()["error"]
    return response.status_code, err["code"], err["message"]


def test_rerank_answers_best_first_as_cohere_and_jina_clients_read(rerank_server,
                                                                   expected_scores):
    """R7.4: ``results`` of ``index`` and ``relevance_score``, best first, equal to
    CrossEncoder.predict within 1e-5; ``top_n`` keeps the best; ``return_documents`` adds
    each ``document`` as ``{"text"}``; documents may be strings or ``{"text"}`` objects."""
    c = rerank_server.client
    body = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    order = list(np.argsort(-expected_scores, kind="stable"))
    assert [r["index"] for r in body["results"]] == order
    assert all(abs(r["relevance_score"] - float(expected_scores[r["index"]])) < 1e-5
               for r in body["results"])
    assert all("document" not in r for r in body["results"])
    assert body["usage"]["total_tokens"] > len(DOCUMENTS)
    top = c.post("/v1/rerank", json={
        "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
        "return_documents": True}).json()
    assert [(r["index"], r["document"]) for r in top["results"]] == \
        [(i, {"text": DOCUMENTS[i]}) for i in order[:2]]
    models = c.get("/v1/models").json()["data"]
    assert [m["task"] for m in models] == ["rerank"]


@pytest.mark.parametrize("body,status,field", [
    ({"query": QUERY, "documents": []}, 400, "documents must not be an empty list"),
    ({"query": "", "documents": ["x"]}, 400, "query must not be an empty string"),
    ({"query": QUERY, "documents": ["x", ""]}, 400, "documents[1] is an empty string"),
    ({"query": QUERY, "documents": ["x", "tokens " * 300]}, 400,
     "documents[1] with the query has"),
    ({"query": QUERY, "documents": ["x"], "top_n": 0}, 400, "top_n"),
    ({"query": QUERY, "documents": [3]}, 400, "documents"),
    ({"documents": ["x"]}, 400, "query"),
    ({"query": QUERY, "documents": ["x"] * 2049}, 413, "documents has 2049 items; limit 2048"),
])
def test_bad_rerank_input_gets_its_error_naming_the_field(rerank_server, body, status, field):
    """R7.2, R7.4: empty documents, an over-limit pair without ``truncate``, too many
    documents and malformed fields are refused with the field named, and the server keeps
    answering."""
    got = error_of(rerank_server.client.post("/v1/rerank", json=body))
    code = "too_large" if status == 413 else "invalid_request"
    assert got[0] == status and got[1] == code and field in got[2]
    ok = rerank_server.client.post("/v1/rerank", json={"query": QUERY, "documents": ["x"]})
    assert ok.status_code == 200


def test_truncate_lets_an_over_limit_pair_through(rerank_server, cross_encoder_dir):
    """R1.1, R7.4: with ``truncate`` the pair is cut longest-first as CrossEncoder cuts it."""
    from sentence_transformers import CrossEncoder

    long_doc = "tokens " * 300
    body = rerank_server.client.post("/v1/rerank", json={
        "query": QUERY, "documents": [long_doc], "truncate": True}).json()
    theirs = CrossEncoder(str(cross_encoder_dir), device="cpu").predict([(QUERY, long_doc)])
    assert abs(body["results"][0]["relevance_score"] - float(theirs[0])) < 1e-5


def test_a_reranker_refuses_classify_and_embeddings(rerank_server):
    """R7.2, R7.4: a classify or embeddings call on a reranker is 422 naming /v1/rerank."""
    for path in ("/v1/classify", "/v1/embeddings"):
        status, code, message = error_of(rerank_server.client.post(path, json={"input": "x"}))
        assert (status, code) == (422, "unsupported") and "/v1/rerank" in message


# -- managed worker processes, one deployment per task -------------------------------------
@pytest.fixture(scope="module")
def task_server(tmp_path_factory, token_classifier_dir, cross_encoder_dir, modernbert_dir,
                xlmr_dir):
    def deployment(folder, backend: str) -> dict:
        return {"provider": "model_runtime", "artifact": str(folder), "backend": backend,
                "replicas": [{"device": "cpu"}],
                "engine": {"num_threads": 1, "timeout_ms": 120_000}}

    doc = {"global": {"router": {"enabled": False}, "model_catalog": {"deployments": {
        "ner": deployment(token_classifier_dir, "onnxruntime"),
        "ce": deployment(cross_encoder_dir, "torch"),
        "mb": deployment(modernbert_dir, "torch"),
        "xlmr": deployment(xlmr_dir, "onnxruntime")}},
        "system": {"decision_model": {"deployment": "ner"}}}}
    path = tmp_path_factory.mktemp("tasks-config") / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    server = Server("--config", str(path)).wait_ready(timeout_s=300)
    yield server
    server.close()


def test_models_report_each_task_and_limit(task_server):
    """R7.4: /v1/models reports each model's task, and the long-context model's own limit
    with calibrated limits that hold one row of it."""
    data = {m["deployment"]: m for m in task_server.client.get("/v1/models").json()["data"]}
    assert {k: m["task"] for k, m in data.items()} == \
        {"ner": "token_classify", "ce": "rerank", "mb": "embed", "xlmr": "embed"}
    assert data["mb"]["max_tokens"] == 8192 and data["xlmr"]["max_tokens"] == 512
    assert data["mb"]["max_num_batched_tokens"] >= 8192


def test_entity_spans_over_a_worker_equal_the_pipeline(task_server, pipeline_spans_http):
    """R7.4: token classification on /v1/classify through a worker process (per-token rows
    over the wire) answers the pipeline's spans."""
    body = task_server.client.post("/v1/classify", json={"model": "ner",
                                                         "input": NER_TEXTS}).json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, theirs in zip(body["data"], pipeline_spans_http, strict=True):
        assert_same_spans(d["entities"], theirs)
    status, code, message = error_of(task_server.client.post(
        "/v1/rerank", json={"model": "ner", "query": "q", "documents": ["d"]}))
    assert (status, code) == (422, "unsupported") and "/v1/classify" in message


def test_truncated_token_classification_spans_the_kept_tokens(task_server, token_classifier_dir):
    """R1.1, R7.4: with ``truncate`` a 30,000-character input (grouped off the event loop)
    keeps its first 126 content tokens (limit 128): its spans are the pipeline's spans of that
    prefix, offsets into the original text."""
    from transformers import pipeline

    body = task_server.client.post("/v1/classify", json={
        "model": "ner", "input": "hello " * 5000, "truncate": True}).json()
    ner = pipeline("token-classification", model=str(token_classifier_dir),
                   aggregation_strategy="simple", device="cpu")
    assert_same_spans(body["data"][0]["entities"], ner("hello " * 126))
    assert body["usage"]["prompt_tokens"] == 128


@pytest.fixture(scope="module")
def pipeline_spans_http(token_classifier_dir):
    from transformers import pipeline

    ner = pipeline("token-classification", model=str(token_classifier_dir),
                   aggregation_strategy="simple", device="cpu")
    return [ner(t) for t in NER_TEXTS]


def test_rerank_pairs_cross_the_worker_wire(task_server, expected_scores):
    """R7.4: the pairs of one request go to one worker as one unit, with type ids."""
    body = task_server.client.post("/v1/rerank", json={
        "model": "ce", "query": QUERY, "documents": DOCUMENTS}).json()
    assert sorted(r["index"] for r in body["results"]) == list(range(len(DOCUMENTS)))
    assert all(abs(r["relevance_score"] - float(expected_scores[r["index"]])) < 1e-5
               for r in body["results"])
    assert task_server.client.get("/v1/models").status_code == 200


def test_modernbert_embeds_a_long_input_over_http(task_server, modernbert_dir):
    """R7.4, R1.1: a 4,096-token input is served end to end within 1e-5 of
    sentence-transformers (8,192 through the Runner: tests/test_tasks.py); one token over
    the 8,192 limit is refused naming the input."""
    from sentence_transformers import SentenceTransformer

    texts = ["hello " * 4094, "short query"]
    body = task_server.client.post("/v1/embeddings", json={"model": "mb", "input": texts},
                                   timeout=300).json()
    ours = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    theirs = SentenceTransformer(str(modernbert_dir), device="cpu").encode(texts)
    assert body["usage"]["prompt_tokens"] == 4096 + 4
    assert np.abs(ours - theirs).max() < 1e-5
    status, code, message = error_of(task_server.client.post(
        "/v1/embeddings", json={"model": "mb", "input": ["x", "hello " * 8191]}))
    assert (status, code) == (400, "invalid_request") and "input[1] has 8193 tokens" in message


def test_xlm_roberta_embeds_over_a_worker(task_server, xlmr_dir):
    """R7.4: an XLM-RoBERTa embedder (onnxruntime, in a worker process) answers
    sentence-transformers' embeddings within 1e-5, up to its 512-token limit."""
    from sentence_transformers import SentenceTransformer

    texts = ["Maria lives in Berlin", "São Paulo 東京 Zürich", "query " * 1000]
    body = task_server.client.post("/v1/embeddings", json={
        "model": "xlmr", "input": texts, "truncate": True}).json()
    ours = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    theirs = SentenceTransformer(str(xlmr_dir), device="cpu").encode(texts, batch_size=1)
    assert np.abs(ours - theirs).max() < 1e-5


def test_raw_scores_cross_the_worker_wire_and_token_classifiers_refuse_them(task_server):
    """R7.5 over managed worker processes: ``raw_scores`` asks the worker for the
    cross-encoder's logit (its sigmoid is the default score); on a token classifier it is
    refused, naming the field."""
    c = task_server.client
    body = {"model": "ce", "query": QUERY, "documents": DOCUMENTS}
    scores = {r["index"]: r["relevance_score"]
              for r in c.post("/v1/rerank", json=body).json()["results"]}
    raw = {r["index"]: r["relevance_score"]
           for r in c.post("/v1/rerank", json={**body, "raw_scores": True}).json()["results"]}
    assert max(abs(1 / (1 + np.exp(-raw[i])) - scores[i]) for i in scores) < 1e-6
    assert min(abs(raw[i] - scores[i]) for i in raw) > 0.1  # the logits, not the scores
    status, code, message = error_of(c.post("/v1/classify", json={
        "model": "ner", "input": "Maria", "raw_scores": True}))
    assert (status, code) == (422, "unsupported") and "raw_scores" in message


def test_normalize_and_dimensions_on_a_model_without_a_normalize_module(task_server):
    """R7.5 on an embedder whose modules do not normalize (ModernBERT, mean pooling):
    ``normalize: true`` L2-normalizes its vectors, ``false`` is its own answer; a cut by
    ``dimensions`` is normalized again only when the vector is (``normalize: true``)."""
    c = task_server.client

    def vectors(**extra) -> np.ndarray:
        r = c.post("/v1/embeddings", json={"model": "mb", "input": NER_TEXTS, **extra})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)

    own = vectors()
    assert np.abs(np.linalg.norm(own, axis=1) - 1).max() > 1e-2  # not unit vectors
    assert np.array_equal(vectors(normalize=False), own)
    unit = own / np.linalg.norm(own, axis=1, keepdims=True)
    assert np.abs(vectors(normalize=True) - unit).max() < 1e-6
    assert np.array_equal(vectors(dimensions=16), own[:, :16])
    cut = own[:, :16] / np.linalg.norm(own[:, :16], axis=1, keepdims=True)
    assert np.abs(vectors(dimensions=16, normalize=True) - cut).max() < 1e-6
