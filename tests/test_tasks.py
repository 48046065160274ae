"""R7.4 on both backends, through the Runner exactly as a worker serves (tokenizer,
micro-batching engine, task head), against the reference libraries on the same tiny real
weights: entity spans equal transformers' token-classification pipeline
(``aggregation_strategy="simple"``), rerank scores equal sentence-transformers'
``CrossEncoder.predict``, and ModernBERT / XLM-RoBERTa embeddings equal
``SentenceTransformer.encode`` up to each model's own limit (8,192 tokens for ModernBERT).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import assert_same_spans
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.calibrate import calibrate
from vllm_srun.runtime.errors import InputTooLong
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs, Task
from vllm_srun.server.frontend.tasks import entities_answer

BACKENDS = ["torch", "onnxruntime"]
NER_TEXTS = ["Maria lives in Berlin and São Paulo, which is unaffordable.",
             "hello", "Jose flew to 東京 with friends from Zürich ☃ [weird] tokens!!",
             "an email: maria.jose@example.com, phone +49 30 1234567"]
QUERY = "where does Maria live?"
DOCUMENTS = ["Maria lives in Berlin.", "The quick brown fox jumps over the lazy dog.",
             "Berlin is the capital of Germany " * 6, "Zürich und München", "a"]


def _start(folder, backend: str, **args) -> Runner:
    runner = Runner.load(str(folder), backend,
                         EngineArgs(num_threads=1, cache_entries=0, **args))
    runner.start()
    return runner


def pipeline_spans(folder) -> list[list[dict]]:
    from transformers import pipeline

    ner = pipeline("token-classification", model=str(folder), aggregation_strategy="simple",
                   device="cpu")
    return [ner(t) for t in NER_TEXTS]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fixture", ["token_classifier_dir", "modernbert_token_classifier_dir"],
                         ids=["bert", "modernbert"])
def test_token_classifier_spans_equal_the_pipeline(fixture, backend, request):
    """R7.4: per input, entity spans (label, score, word, character offsets) grouped as the
    pipeline's "simple" aggregation does, for a BERT and a ModernBERT token classifier; the
    rows of one request share forwards."""
    folder = request.getfixturevalue(fixture)
    manifest = resolve(str(folder))
    assert manifest.task is Task.TOKEN_CLASSIFY
    assert manifest.labels == ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
    runner = _start(folder, backend)
    try:
        logits, tokens = runner.submit(NER_TEXTS)
        logits = logits.result(timeout=60)
    finally:
        runner.stop()
    assert logits.ndim == 3 and logits.shape[2] == 5
    data = entities_answer(_Info(manifest), NER_TEXTS, False, logits)
    assert sum(len(d["entities"]) for d in data) > 4  # the grouping has work to do
    for d, theirs in zip(data, pipeline_spans(folder), strict=True):
        assert_same_spans(d["entities"], theirs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_modernbert_sequence_classifier_gives_the_heads_logits(modernbert_classifier_dir,
                                                                backend):
    """R7.4: a ModernBERT sequence classifier (an intent router's shape) gives transformers'
    logits within 1e-5 on both backends, rows of different lengths batched together."""
    import torch
    from transformers import ModernBertForSequenceClassification

    manifest = resolve(str(modernbert_classifier_dir))
    assert manifest.task is Task.CLASSIFY and manifest.labels == ("math", "code", "other")
    texts = NER_TEXTS + ["solve x^2 = 4 " * 40]
    runner = _start(modernbert_classifier_dir, backend)
    try:
        ours = runner.submit(texts)[0].result(timeout=60)
        rows = runner.tokenizer.encode(texts)
    finally:
        runner.stop()
    model = ModernBertForSequenceClassification.from_pretrained(modernbert_classifier_dir)
    with torch.no_grad():
        theirs = np.concatenate([model.eval()(input_ids=torch.tensor([r])).logits.numpy()
                                 for r in rows])
    assert np.abs(ours - theirs).max() < 1e-5


class _Info:
    """What the front end knows of a deployment (pool.ModelInfo's fields used here)."""

    def __init__(self, manifest) -> None:
        self.artifact, self.revision = manifest.path, manifest.revision
        self.hub_revision = None  # a local folder, not a Hub id
        self.labels = manifest.labels


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_encoder_dir), device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerank_scores_equal_cross_encoder_predict(cross_encoder_dir, cross_encoder, backend):
    """R7.4: each (query, document) pair is a row tokenized as a text pair (type ids
    included); scores equal CrossEncoder.predict (sigmoid of the one logit) within 1e-5,
    also when ``truncate`` cuts a pair longest-first at the model's limit."""
    manifest = resolve(str(cross_encoder_dir))
    assert manifest.task is Task.RERANK and manifest.sigmoid
    long_doc = "tokens " * 300
    pairs = [(QUERY, d) for d in DOCUMENTS]
    runner = _start(cross_encoder_dir, backend)
    try:
        scores = runner.submit(pairs)[0].result(timeout=60).reshape(-1)
        cut = runner.submit([(QUERY, long_doc)], truncate=True)[0].result(timeout=60)
        with pytest.raises(InputTooLong, match=r"documents\[0\] with the query has \d+ tokens"):
            runner.submit([(QUERY, long_doc)], field="documents")
    finally:
        runner.stop()
    theirs = cross_encoder.predict(pairs + [(QUERY, long_doc)], batch_size=4)
    assert np.abs(scores - theirs[:-1]).max() < 1e-5
    assert abs(float(cut.reshape(-1)[0]) - float(theirs[-1])) < 1e-5
    # the type ids matter: the same pairs without them score differently
    assert np.abs(scores - _scores_without_type_ids(cross_encoder, pairs)).max() > 1e-4


def _scores_without_type_ids(cross_encoder, pairs) -> np.ndarray:
    import torch

    enc = cross_encoder.tokenizer([q for q, _ in pairs], [d for _, d in pairs],
                                  padding=True, return_tensors="pt")
    enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    with torch.no_grad():
        return torch.sigmoid(cross_encoder.model(**enc).logits).reshape(-1).numpy()


LONG_COUNTS = [1, 7, 100, 511]


def _st_reference(folder, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == resolve(str(folder)).max_tokens
    return model.encode(texts, batch_size=1, convert_to_numpy=True)  # no padding to 8k


@pytest.mark.parametrize("backend", BACKENDS)
def test_xlm_roberta_matches_sentence_transformers_to_its_limit(xlmr_dir, backend):
    """R7.4: XLM-RoBERTa (positions offset by the padding id: 514 positions, 512 tokens)
    on both backends within 1e-5 of sentence-transformers, up to its own limit."""
    manifest = resolve(str(xlmr_dir))
    assert manifest.max_tokens == 512
    texts = ["Maria lives in Berlin", "São Paulo 東京 Zürich", "x"] + [
        "query " * n for n in LONG_COUNTS]
    runner = _start(xlmr_dir, backend)
    try:
        futures = [runner.submit([t], truncate=True)[0] for t in texts]
        ours = np.concatenate([f.result(timeout=60) for f in futures])
    finally:
        runner.stop()
    assert np.abs(ours - _st_reference(xlmr_dir, texts)).max() < 1e-5


MODERNBERT_TEXTS = ["hello " * 8190, "Maria lives in Berlin", "the quick brown fox " * 100, "x"]


@pytest.fixture(scope="module")
def modernbert_reference(modernbert_dir) -> np.ndarray:
    return _st_reference(modernbert_dir, MODERNBERT_TEXTS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_modernbert_serves_8192_tokens_within_1e5(modernbert_dir, modernbert_reference,
                                                  backend):
    """R7.4, R3.2: a ModernBERT embedder's own limit is 8,192 tokens; calibration keeps
    room for one row of the longest input; inputs from 1 token to the full 8,192 (with
    shorter ones micro-batched beside it) equal sentence-transformers within 1e-5."""
    manifest = resolve(str(modernbert_dir))
    assert manifest.max_tokens == 8192
    texts = MODERNBERT_TEXTS
    runner = _start(modernbert_dir, backend, max_num_batched_tokens=8192)
    try:
        args = calibrate(runner, None, None)
        assert args.max_num_batched_tokens >= 8192
        future, tokens = runner.submit(texts)
        ours = future.result(timeout=300)
        with pytest.raises(InputTooLong, match="8193 tokens"):
            runner.submit(["hello " * 8191])
    finally:
        runner.stop()
    assert tokens == 8192 + 6 + 402 + 3
    assert np.abs(ours - modernbert_reference).max() < 1e-5


@pytest.mark.parametrize("fixture", ["token_classifier_dir", "cross_encoder_dir"])
def test_adaptive_threads_check_and_shadow_the_new_tasks(fixture, request, tmp_path):
    """R4.3, R4.5 for R7.4's tasks: the start-up golden check passes on per-token answers
    (rows of different lengths) and on pair rows, and mode-1 shadow passes at another count
    reproduce the served answers bit for bit (onnxruntime, exact across counts here)."""
    from tests.conftest import FAST, wait_for
    from vllm_srun.records.host_record import HostRecord, Scope
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.tuner.adaptive import AdaptiveThreads
    from vllm_srun.tuner.golden import golden_rows
    from vllm_srun.tuner.modes import AdaptiveMode

    manifest = resolve(str(request.getfixturevalue(fixture)))
    backend = load_backend(manifest, "onnxruntime")
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, cache_entries=0))
    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2),
                            Scope("test-host", manifest.revision, "onnxruntime"),
                            HostRecord(tmp_path / "r.sqlite"), runner.engine.forward_batch, FAST)
    runner.engine.threads = tuner
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    try:
        assert runner.ready, runner.not_ready_reason
        inputs = ([(QUERY, d) for d in DOCUMENTS] if manifest.task is Task.RERANK
                  else NER_TEXTS)
        for _ in range(4):
            runner.submit(inputs)[0].result(timeout=60)
            wait_for(lambda: tuner.pending_shadows() == 0, 30)
    finally:
        runner.stop()
    assert tuner.ledger.comparisons >= 2 and tuner.ledger.retired is None
