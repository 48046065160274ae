"""R7.1/R7.2 over real HTTP: a ``vllm-srun serve`` process, the official openai client, and every
bad input answered with its error while the server keeps answering good requests correctly."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from tests.conftest import L6, words


@pytest.fixture(scope="module")
def client(l6_server):
    return l6_server.client


@pytest.fixture(scope="module")
def reference(client):
    """The server's own answer for a probe text, to check nothing changed after bad input."""
    return np.array(client.post("/v1/embeddings", json={"input": "probe text"}).json()
                    ["data"][0]["embedding"], dtype=np.float32)


def assert_still_serves(client, reference):
    body = client.post("/v1/embeddings", json={"input": ["probe text"], "model": L6}).json()
    assert np.array_equal(np.array(body["data"][0]["embedding"], np.float32), reference)


def test_openai_client_float_and_base64(l6_server):
    oa = openai.OpenAI(base_url=f"{l6_server.url}/v1", api_key="unused")
    texts = ["hello world", words(40)]
    as_float = oa.embeddings.create(model=L6, input=texts, encoding_format="float")
    as_b64 = oa.embeddings.create(model=L6, input=texts)  # the client asks for base64
    assert [d.index for d in as_float.data] == [0, 1]
    assert as_float.usage.prompt_tokens == 4 + 42
    a = np.array([d.embedding for d in as_float.data], np.float32)
    b = np.array([d.embedding for d in as_b64.data], np.float32)
    assert a.shape == (2, 384) and np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)


def test_base64_is_little_endian_float32(client):
    body = client.post("/v1/embeddings",
                       json={"input": "x", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    plain = client.post("/v1/embeddings", json={"input": "x"}).json()["data"][0]["embedding"]
    assert np.array_equal(vec, np.array(plain, np.float32))


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == L6 and models["data"][0]["max_tokens"] == 256
    assert client.get("/health").json() == {"status": "ok", "model": L6}
    text = client.get("/metrics").text
    for name in ("vllm_srun_requests_total", "vllm_srun_forward_seconds_bucket",
                 "vllm_srun_batch_rows_bucket"):
        assert name in text


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_request"),
    (b'{"input": []}', 400, "invalid_request"),
    (b'{"input": 5}', 400, "invalid_request"),
    (b'{"input": [1, "a"]}', 400, "invalid_request"),
    (b'{"input": ""}', 400, "invalid_request"),
    (b'{"input": "a", "encoding_format": "hex"}', 400, "invalid_request"),
    (b'{"input": "a", "extra_field": 1}', 400, "invalid_request"),
    (b'{"input": "a", "truncate": "yes"}', 400, "invalid_request"),
    (b'{"input": "a", "model": "nope"}', 404, "model_not_found"),
    (b'{"input": [[101, 102]]}', 422, "unsupported"),
    (b'{"input": "a", "dimensions": 385}', 400, "invalid_request"),
    (b'{"input": "a", "dimensions": 0}', 400, "invalid_request"),
    (b'{"input": "a", "prompt_name": "query"}', 400, "invalid_request"),
    (f'{{"input": "{words(255)}"}}'.encode(), 400, "invalid_request"),
    (("[" + ",".join(['"a"'] * 2049) + "]").join(['{"input": ', "}"]).encode(), 413, "too_large"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_its_error_and_the_server_still_serves(client, reference, body, status,
                                                               code):
    r = client.post("/v1/embeddings", content=body,
                    headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    assert_still_serves(client, reference)


def test_too_long_names_the_input_and_truncate_cuts_it(client, reference):
    r = client.post("/v1/embeddings", json={"input": ["ok", words(300)]})
    assert r.status_code == 400 and "input[1] has 302 tokens" in r.json()["error"]["message"]
    cut = client.post("/v1/embeddings", json={"input": words(300), "truncate": True}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    assert_still_serves(client, reference)


def test_body_over_the_byte_limit_is_413(client, reference):
    r = client.post("/v1/embeddings", content=b'{"input": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert_still_serves(client, reference)


def test_bad_deadline_header_and_classify_on_an_embedder(client, reference):
    r = client.post("/v1/embeddings", json={"input": "a"},
                    headers={"x-request-timeout-ms": "soon"})
    assert r.status_code == 400 and "x-request-timeout-ms" in r.json()["error"]["message"]
    r = client.post("/v1/classify", json={"input": "a"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsupported"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert_still_serves(client, reference)


def test_caller_deadline_gives_504_and_the_server_still_serves(client, reference):
    texts = [words(250) + f" {i}" for i in range(64)]
    r = client.post("/v1/embeddings", json={"input": texts},
                    headers={"x-request-timeout-ms": "1"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert_still_serves(client, reference)


def test_concurrent_good_and_bad_requests_all_get_their_own_answer(client, reference):
    def call(i):
        if i % 3 == 0:
            return client.post("/v1/embeddings", json={"input": words(400)}).status_code
        body = client.post("/v1/embeddings", json={"input": ["probe text"]}).json()
        return np.array_equal(np.array(body["data"][0]["embedding"], np.float32), reference)

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(call, range(36)))
    assert results.count(400) == 12 and results.count(True) == 24
