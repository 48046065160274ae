"""A classification head in a local artifact is served by /v1/classify, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertForSequenceClassification

from tests.conftest import Server
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs

TEXTS = ["I loved it", "terrible service, never again", "it was fine I guess"]


@pytest.fixture(scope="module")
def expected_logits(classifier_dir):
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.tokenizer import Tokenizer

    m = resolve(str(classifier_dir))
    tok = Tokenizer(m.tokenizer_path, m.max_tokens)
    model = BertForSequenceClassification.from_pretrained(classifier_dir).eval()
    with torch.no_grad():
        return np.concatenate([model(input_ids=torch.tensor([ids])).logits.numpy()
                               for ids in tok.encode(TEXTS)])


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_both_backends_give_the_heads_logits(classifier_dir, expected_logits, backend):
    runner = Runner.load(str(classifier_dir), backend, EngineArgs(num_threads=1))
    runner.start()
    try:
        logits = np.concatenate([runner.submit([t])[0].result(timeout=60) for t in TEXTS])
    finally:
        runner.stop()
    assert np.abs(logits - expected_logits).max() < 1e-5


@pytest.mark.parametrize("replicas", [[], ["-dp", "2"]], ids=["in-process", "two-workers"])
def test_classify_over_http(classifier_dir, expected_logits, replicas):
    server = Server(str(classifier_dir), "--threads", "1", *replicas).wait_ready()
    try:
        body = server.client.post("/v1/classify", json={"input": TEXTS, "top_k": 2}).json()
        emb = server.client.post("/v1/embeddings", json={"input": "x"})
    finally:
        server.close()
    labels = ("negative", "neutral", "positive")
    assert [d["label"] for d in body["data"]] == [labels[i] for i in
                                                  expected_logits.argmax(axis=1)]
    probs = np.exp(expected_logits) / np.exp(expected_logits).sum(axis=1, keepdims=True)
    for d, p in zip(body["data"], probs, strict=True):
        assert len(d["scores"]) == 2 and abs(d["score"] - p.max()) < 1e-5
    assert emb.status_code == 422 and emb.json()["error"]["code"] == "unsupported"
