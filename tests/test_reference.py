"""R1.3: both backends give sentence-transformers' embeddings within 1e-5, 1 token to the limit.

Inputs are served through the Runner (tokenizer, micro-batching engine, pooling) exactly as the
HTTP server serves them; long inputs are cut with ``truncate`` as sentence-transformers cuts.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import L3, L6, words
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs

CONTENT_TOKENS = [1, 2, 3, 5, 8, 11, 16, 31, 64, 100, 127, 200, 254]
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé, emoji 🚀 and CJK 漢字",
             "a", "Embeddings for search: queries vs. passages!"]


@pytest.fixture(scope="module")
def reference_l6():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve(L6).path, device="cpu")


def _serve(model: str, backend: str, texts: list[str], truncate: bool) -> np.ndarray:
    runner = Runner.load(model, backend, EngineArgs(num_threads=1, cache_entries=0))
    runner.start()
    try:
        futures = [runner.submit([t], truncate)[0] for t in texts]
        return np.concatenate([f.result(timeout=120) for f in futures])
    finally:
        runner.stop()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_l6_matches_sentence_transformers_up_to_the_limit(backend, reference_l6):
    texts = [words(n) for n in CONTENT_TOKENS] + SENTENCES + [words(400)]  # last one cut
    ours = _serve(L6, backend, texts, truncate=True)
    theirs = reference_l6.encode(texts, batch_size=8, convert_to_numpy=True)
    assert reference_l6.max_seq_length == resolve(L6).max_tokens == 256
    assert ours.shape == theirs.shape == (len(texts), 384)
    assert np.abs(ours - theirs).max() < 1e-5


def test_l3_matches_its_own_onnx_pooled_output():
    manifest = resolve(L3)
    texts = [words(n) for n in (1, 7, 30, 126)] + SENTENCES
    ours = _serve(L3, "onnxruntime", texts, truncate=False)
    from vllm_srun.runtime.tokenizer import Tokenizer

    tok = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
    session = ort.InferenceSession(manifest.onnx_path, providers=["CPUExecutionProvider"])
    pooled_name = next(o.name for o in session.get_outputs() if o.shape[-1:] == [384]
                       and len(o.shape) == 2)
    for i, ids in enumerate(tok.encode(texts)):
        feed = {"input_ids": np.array([ids], np.int64),
                "attention_mask": np.ones((1, len(ids)), np.int64)}
        (theirs,) = session.run([pooled_name], feed)
        assert np.abs(ours[i] - theirs[0]).max() < 1e-5
