"""R7.5, R7.2, R7.4: a text-embeddings-inference client switches by changing the URL.

Real ``vllm-srun serve`` processes over loopback: an all-MiniLM-L6-v2 folder whose
sentence-transformers config declares prompts (and a default one), the tiny cross-encoder and
the tiny classifier. Requests are TEI's own (built from its OpenAPI document, version 1.9.3,
in tests/data/), answers are validated against its schemas, and they equal our ``/v1`` routes'
answers and the reference libraries'.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests import openapi_check
from tests.conftest import L6, Server
from vllm_srun.runtime.artifact import resolve

TEI = "tei_openapi.json"
PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["What is Deep Learning?", "Zürich und München 漢字 🚀"]


@pytest.fixture(scope="module")
def prompted_dir(tmp_path_factory):
    """L6's files (linked) with a config_sentence_transformers.json that declares prompts
    and ``default_prompt_name``."""
    src = resolve(L6).path
    folder = tmp_path_factory.mktemp("prompted-l6")
    for name in os.listdir(src):
        if name != "config_sentence_transformers.json":
            os.symlink(os.path.join(src, name), folder / name)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": PROMPTS, "default_prompt_name": "passage"}))
    return folder


@pytest.fixture(scope="module")
def server(prompted_dir):
    s = Server(str(prompted_dir), "--threads", "1").wait_ready()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(prompted_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(prompted_dir), device="cpu")


def tei_error(response, status: int, *words: str) -> str:
    """The answer is TEI's ErrorResponse with our R7.2 status and code; its message names
    ``words``."""
    assert response.status_code == status, response.text
    body = response.json()
    openapi_check.validate(TEI, "ErrorResponse", body)
    assert body["code"] and all(w in body["error"] for w in words), body
    return body["error"]


def v1_vectors(client, **body) -> np.ndarray:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_teis_own_request_examples_get_answers_valid_for_its_schemas(
        server, cross_encoder_server, classifier_server):
    """Each offered TEI route, sent the request its document exemplifies, answers 200 with
    a body valid for the route's answer schema; ``/info`` too."""
    ids = server.client.post("/tokenize", json={"inputs": TEXTS[0]}).json()[0]
    fallback = {"inputs": TEXTS[0], "query": TEXTS[0], "texts": TEXTS,
                "ids": [t["id"] for t in ids]}
    routes = [(server, "/embed"), (server, "/tokenize"), (server, "/decode"),
              (cross_encoder_server, "/rerank"), (classifier_server, "/predict")]
    for target, path in routes:
        schema = openapi_check.request_schema(TEI, path)
        body = openapi_check.example_request(TEI, schema, fallback)
        r = target.client.post(path, json=body)
        assert r.status_code == 200, (path, body, r.text)
        openapi_check.validate(TEI, openapi_check.response_schema(TEI, path, "post", "200"),
                               r.json())
    similarity = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}
    openapi_check.validate(TEI, "SimilarityRequest", similarity)
    r = server.client.post("/similarity", json=similarity)
    openapi_check.validate(TEI, "SimilarityResponse", r.json())
    assert r.json()[0] == pytest.approx(1.0, abs=1e-6)
    for target in (server, cross_encoder_server, classifier_server):
        info = target.client.get("/info").json()
        openapi_check.validate(TEI, "Info", info)
    assert info["model_type"] == {"classifier": {
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
        "label2id": {"negative": 0, "neutral": 1, "positive": 2}}}
    info = server.client.get("/info").json()
    assert (info["model_type"], info["max_input_length"], info["auto_truncate"]) == (
        {"embedding": {"pooling": "mean"}}, 256, False)


def test_embed_equals_v1_embeddings_and_sentence_transformers_with_prompts(server, reference):
    """/embed and /v1/embeddings give the same vectors; both put the model's default prompt
    before each input, or the one ``prompt_name`` names, as sentence-transformers does."""
    c = server.client
    embed = np.array(c.post("/embed", json={"inputs": TEXTS}).json(), dtype=np.float32)
    assert np.array_equal(embed, v1_vectors(c, input=TEXTS))
    assert np.abs(embed - reference.encode(TEXTS)).max() < 1e-5  # default: "passage: "
    query = np.array(c.post("/embed", json={"inputs": TEXTS, "prompt_name": "query"}).json())
    assert np.abs(query - reference.encode(TEXTS, prompt_name="query")).max() < 1e-5
    assert np.array_equal(query.astype(np.float32),
                          v1_vectors(c, input=TEXTS, prompt_name="query"))
    assert np.abs(query - embed).max() > 1e-3  # the prompt changed the vector
    message = tei_error(c.post("/embed", json={"inputs": "x", "prompt_name": "doc"}), 400,
                        "prompt_name 'doc'", "'passage'", "'query'")
    assert "model" in message
    r = c.post("/v1/embeddings", json={"input": "x", "prompt_name": "doc"})
    assert r.status_code == 400 and "'query'" in r.json()["error"]["message"]


def test_normalize_false_answers_the_vector_before_the_normalize_module(server, reference):
    """TEI's ``normalize: false`` (also on /v1/embeddings) answers the pooled vector the
    model's Normalize module would divide: asked after the normalized one of the same texts
    (the worker's cache keeps them apart)."""
    from sentence_transformers import SentenceTransformer

    c = server.client
    texts = ["normalize me", "and me too, please"]
    normalized = np.array(c.post("/embed", json={"inputs": texts}).json(), dtype=np.float32)
    raw = np.array(c.post("/embed", json={"inputs": texts, "normalize": False}).json(),
                   dtype=np.float32)
    unnormalized = SentenceTransformer(modules=[reference[0], reference[1]], device="cpu")
    expected = unnormalized.encode(["passage: " + t for t in texts])
    assert np.abs(raw - expected).max() < 1e-4 * np.abs(expected).max()
    assert np.linalg.norm(raw, axis=1).min() > 1.5  # not unit vectors
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - normalized).max() < 1e-6
    assert np.array_equal(raw, v1_vectors(c, input=texts, normalize=False))
    assert np.array_equal(normalized, v1_vectors(c, input=texts))


def test_dimensions_keep_the_first_n_then_normalize(server):
    """OpenAI's and TEI's ``dimensions``: the first N of the vector, L2-normalized again;
    out of 1..hidden size it is a 400 naming the field; infinity's 0 means all."""
    c = server.client
    full = v1_vectors(c, input=TEXTS)
    for dims in (1, 64, 384):
        cut = v1_vectors(c, input=TEXTS, dimensions=dims)
        expected = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        assert cut.shape == (2, dims) and np.abs(cut - expected).max() < 1e-6
        tei = np.array(c.post("/embed", json={"inputs": TEXTS, "dimensions": dims}).json(),
                       dtype=np.float32)
        assert np.array_equal(tei, cut)
    assert np.array_equal(v1_vectors(c, input=TEXTS, dimensions=384), full)
    raw_cut = v1_vectors(c, input=TEXTS, dimensions=8, normalize=False)
    raw = v1_vectors(c, input=TEXTS, normalize=False)
    assert np.array_equal(raw_cut, raw[:, :8])
    for dims in (0, 385, -3):
        tei_error(c.post("/embed", json={"inputs": "x", "dimensions": dims}), 400,
                  "dimensions must be between 1 and 384", str(dims))
        r = c.post("/v1/embeddings", json={"input": "x", "dimensions": dims})
        assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]


def test_tokenize_and_decode_answer_as_tei_does(server):
    """/tokenize: special tokens by their text, the others by the text they cover with UTF-8
    byte offsets, the model's prompt included; /decode turns ids back into text."""
    c = server.client
    tokens = c.post("/tokenize", json={"inputs": "héllo world", "prompt_name": "query"}).json()
    assert tokens == [[
        {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
        {"id": 23032, "text": "query", "special": False, "start": 0, "stop": 5},
        {"id": 1024, "text": ":", "special": False, "start": 5, "stop": 6},
        {"id": 7592, "text": "héllo", "special": False, "start": 7, "stop": 13},
        {"id": 2088, "text": "world", "special": False, "start": 14, "stop": 19},
        {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}]]
    plain = c.post("/tokenize", json={"inputs": ["a b", "c"], "add_special_tokens": False})
    assert [[t["text"] for t in row] for row in plain.json()] == [["passage", ":", "a", "b"],
                                                                  ["passage", ":", "c"]]
    ids = [t["id"] for t in tokens[0]]
    assert c.post("/decode", json={"ids": ids}).json() == ["query : hello world"]
    assert c.post("/decode", json={"ids": [ids, ids[3:5]], "skip_special_tokens": False}
                  ).json() == ["[CLS] query : hello world [SEP]", "hello world"]
    tei_error(c.post("/decode", json={"ids": [101, 99999]}), 400, "99999", "0 to 30521")
    tei_error(c.post("/decode", json={"ids": []}), 400, "ids")
    tei_error(c.post("/tokenize", json={"inputs": []}), 400, "inputs")


@pytest.mark.parametrize("path,words", [
    ("/embed_all", ("per-token vectors are not available", "use /embed")),
    ("/embed_sparse", ("not an embedding model with SPLADE pooling", "use /embed")),
])
def test_unpooled_routes_check_the_request_then_answer_teis_424(server, classifier_server,
                                                                path, words):
    """R7.5: ``/embed_all`` and ``/embed_sparse`` take TEI's own request (from its document)
    and answer TEI's documented 424 (``Backend``) for a model that cannot give their output:
    the workers return pooled vectors only, and the model has no SPLADE head (nor does any
    model here). The request is checked first, as TEI checks it (400, 413, 422)."""
    body = openapi_check.example_request(TEI, openapi_check.request_schema(TEI, path),
                                         {"inputs": TEXTS})
    assert openapi_check.response_schema(TEI, path, "post", "424") == "ErrorResponse"
    for target, said in ((server, words), (classifier_server, ("is not an embedding model",
                                                               "(classify)"))):
        r = target.client.post(path, json=body)
        assert tei_error(r, 424, path, *said)
        assert r.json()["error_type"] == "Backend"
    c = server.client
    tei_error(c.post(path, json={"inputs": []}), 400, "inputs must not be an empty list")
    tei_error(c.post(path, json={"inputs": ["x"] * 2049}), 413, "inputs has 2049 items")
    tei_error(c.post(path, json={"inputs": "x", "normalize": True}), 400, "'normalize'")
    tei_error(c.post(path, json={"inputs": [[101, 102]]}), 422, "token-id")
    counted = f'vllm_srun_requests_total{{endpoint="{path[1:]}",outcome="not_available"}}'
    assert counted in c.get("/metrics").text


def test_peer_fields_are_honoured_and_unknown_ones_refused_naming_them(server):
    """R7.5: TEI's and OpenAI's fields are accepted (``user`` ignored); a field no peer sends
    is a 400 naming every unknown one; ``truncation_direction: Left`` is refused where it
    would cut; errors on TEI's routes keep the R7.2 status in TEI's shape."""
    c = server.client
    long_text = "hello " * 300
    r = c.post("/v1/embeddings", json={"input": "x", "user": "u-1", "encoding_format": "float",
                                       "truncation_direction": "Right", "truncate": True})
    assert r.status_code == 200
    message = tei_error(c.post("/embed", json={"inputs": "x", "pooling": "cls", "foo": 1}),
                        400, "'pooling'", "'foo'")
    assert "'prompt_name'" in message  # and what the route accepts
    r = c.post("/v1/embeddings", json={"input": "x", "raw_scores": True})
    assert r.status_code == 400 and "'raw_scores'" in r.json()["error"]["message"]
    tei_error(c.post("/embed", json={"inputs": long_text, "truncate": True,
                                     "truncation_direction": "Left"}), 422, "Left")
    ok = c.post("/embed", json={"inputs": "x", "truncation_direction": "Left"})
    assert ok.status_code == 200  # nothing is cut: the direction changes nothing
    tei_error(c.post("/embed", json={"inputs": long_text}), 400, "inputs[0] has", "truncate")
    cut = c.post("/embed", json={"inputs": long_text, "truncate": True})
    assert cut.status_code == 200
    tei_error(c.post("/embed", json={"inputs": [[101, 102]]}), 422, "token-id")


@pytest.mark.parametrize("path, target, use", [
    ("/embed", "classifier_server", "/predict"),
    ("/embed", "cross_encoder_server", "/rerank"),
    ("/similarity", "classifier_server", "/predict"),
    ("/predict", "server", "/embed"),
    ("/rerank", "server", "/embed"),
    ("/rerank", "classifier_server", "/predict"),
])
def test_a_model_of_another_task_gets_teis_424_on_teis_routes(request, path, target, use):
    """R7.5, R7.2: TEI answers a model of the wrong type on an inference route with a
    backend error: its document lists 424 (an ErrorResponse) on each of these routes, and
    so does this server, with ``error_type`` ``Backend`` and a message naming the route
    that serves the model. OpenAI's routes keep their 422 ``unsupported``."""
    inputs = ({"source_sentence": TEXTS[0], "sentences": TEXTS} if path == "/similarity"
              else TEXTS[0])
    fallback = {"inputs": inputs, "query": TEXTS[0], "texts": TEXTS}
    body = openapi_check.example_request(TEI, openapi_check.request_schema(TEI, path), fallback)
    assert openapi_check.response_schema(TEI, path, "post", "424") == "ErrorResponse"
    c = request.getfixturevalue(target).client
    r = c.post(path, json=body)
    assert tei_error(r, 424, path, f"use {use}")
    assert (r.json()["error_type"], r.json()["code"]) == ("Backend", "not_available")
    v1 = {"/embed": ("/v1/embeddings", {"input": "x"}),
          "/similarity": ("/v1/embeddings", {"input": "x"}),
          "/predict": ("/v1/classify", {"input": "x"}),
          "/rerank": ("/v1/rerank", {"query": "q", "documents": ["a"]})}[path]
    r = c.post(v1[0], json=v1[1])
    assert (r.status_code, r.json()["error"]["code"]) == (422, "unsupported"), r.text


def test_tei_rerank_and_predict_equal_v1_rerank_and_the_heads_logits(cross_encoder_server,
                                                                     cross_encoder_dir):
    """/rerank (``texts``) ranks as /v1/rerank scores, best first; ``return_text`` adds each
    text; ``raw_scores`` answers the head's logit (no sigmoid); /predict on a pair answers
    the same score."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    c = cross_encoder_server.client
    query, texts = "where does Maria live?", ["Maria lives in Berlin.", "a", "cats", "Berlin"]
    ranks = c.post("/rerank", json={"query": query, "texts": texts, "return_text": True}).json()
    ours = c.post("/v1/rerank", json={"query": query, "documents": texts}).json()["results"]
    assert [(r["index"], r["score"]) for r in ranks] == \
        [(r["index"], r["relevance_score"]) for r in ours]
    assert [r["text"] for r in ranks] == [texts[r["index"]] for r in ranks]
    raw = c.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True}).json()
    tok = AutoTokenizer.from_pretrained(cross_encoder_dir)
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
    with torch.no_grad():
        logits = model(**tok([query] * len(texts), texts, padding=True,
                             return_tensors="pt")).logits[:, 0].numpy()
    by_index = {r["index"]: r["score"] for r in raw}
    assert max(abs(by_index[i] - float(logits[i])) for i in range(len(texts))) < 1e-4
    assert [r["index"] for r in raw] == list(np.argsort(-logits, kind="stable"))
    v1_raw = c.post("/v1/rerank", json={"query": query, "documents": texts,
                                        "raw_scores": True}).json()["results"]
    assert {r["index"]: r["relevance_score"] for r in v1_raw} == by_index
    pair = c.post("/predict", json={"inputs": [query, texts[0]]}).json()
    assert pair == [{"label": "LABEL_0", "score": ours[[r["index"] for r in ours].index(0)]
                     ["relevance_score"]}]
    tei_error(c.post("/rerank", json={"query": query, "texts": []}), 400, "texts")
    tei_error(c.post("/rerank", json={"query": query, "texts": ["a", ""]}), 400, "texts[1]")


def test_predict_on_a_classifier_answers_every_label_best_first(classifier_server):
    """/predict: one input (a string or a pair) -> its labels best first, scores equal to
    /v1/classify's; a batch -> one list per input; ``raw_scores`` -> the logits."""
    c = classifier_server.client
    single = c.post("/predict", json={"inputs": "I love it"}).json()
    ours = c.post("/v1/classify", json={"input": "I love it"}).json()["data"][0]["scores"]
    assert single == ours
    batch = c.post("/predict", json={"inputs": [["I love it"], ["a", "pair of texts"]]}).json()
    assert batch[0] == single and len(batch[1]) == 3
    openapi_check.validate(TEI, "PredictResponse", batch)
    pair = c.post("/predict", json={"inputs": ["a", "pair of texts"]}).json()
    assert pair == batch[1]
    raw = c.post("/predict", json={"inputs": "I love it", "raw_scores": True}).json()
    logits = np.array([r["score"] for r in sorted(raw, key=lambda r: r["label"])])
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert np.abs(probs - [r["score"] for r in sorted(single, key=lambda r: r["label"])]
                  ).max() < 1e-6
    v1_raw = c.post("/v1/classify", json={"input": "I love it", "raw_scores": True}).json()
    assert v1_raw["data"][0]["scores"] == raw
    tei_error(c.post("/predict", json={"inputs": ["a", "b", "c"]}), 400, "pair")
    tei_error(c.post("/predict", json={"inputs": [["a", "b", "c"]]}), 400, "inputs[0]")


@pytest.mark.parametrize("model", ["l6", "cross_encoder"])
def test_one_forward_answers_raw_and_finished_rows_each_as_asked(model, cross_encoder_dir):
    """A forward mixing rows asked raw (``normalize: false``, ``raw_scores``) with others
    answers each as asked: a finished row is bit for bit what a forward without raw rows
    gives; a raw row is the value before the model's last step (Normalize, sigmoid)."""
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.pooling import l2_normalize
    from vllm_srun.runtime.tokenizer import Tokenizer

    manifest = resolve(L6 if model == "l6" else str(cross_encoder_dir))
    backend = load_backend(manifest, "torch")
    tok = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
    items = ["first row", "the second, longer row", "third"] if model == "l6" else \
        [("q", "first row"), ("q", "the second, longer row"), ("q", "third")]
    rows = tok.rows(items)
    finished = backend.forward(pad(rows.ids, rows.type_ids), 1).outputs
    mixed = backend.forward(pad(rows.ids, rows.type_ids, [False, True, False]), 1).outputs
    assert np.array_equal(mixed[[0, 2]], finished[[0, 2]])
    if model == "l6":
        assert np.linalg.norm(mixed[1]) > 1.5
        assert np.abs(l2_normalize(mixed[1:2]) - finished[1:2]).max() < 1e-6
    else:
        assert manifest.sigmoid and abs(1 / (1 + np.exp(-mixed[1, 0])) - finished[1, 0]) < 1e-6
    backend.close()


def test_the_api_key_guards_the_peers_routes_too():
    """With a key set, every path but /health, /metrics and the OpenAPI pages needs it:
    TEI's and infinity's inference routes as much as /v1's (also below a mount prefix)."""
    import asyncio

    from vllm_srun.server.frontend.auth import RequireApiKey

    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    guard = RequireApiKey(inner, "s3cret-key-for-tests")

    def status(path: str, root: str = "", key: bool = False) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", b"Bearer s3cret-key-for-tests")] if key else []
        before = len(reached)
        asyncio.run(guard({"type": "http", "path": root + path, "root_path": root,
                           "headers": headers}, None, send))
        return 200 if len(reached) > before else sent[0]["status"]

    for path in ("/embed", "/rerank", "/predict", "/similarity", "/tokenize", "/decode",
                 "/info", "/embeddings", "/classify", "/models", "/v1/embeddings"):
        assert (status(path), status(path, "/prefix"), status(path, key=True)) == \
            (401, 401, 200), path
    for path in ("/health", "/metrics", "/openapi.json", "/docs"):
        assert (status(path), status(path, "/prefix")) == (200, 200), path
