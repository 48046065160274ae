"""What a task makes of a model's rows (R7.4): entity spans from per-token logits, and the
order of reranked documents. Pure functions over plain data; no HTTP here.

Entity spans follow transformers' token-classification pipeline with
``aggregation_strategy="simple"``: each non-special token takes its argmax label and that
label's softmax probability; adjacent tokens whose labels share a tag join one span unless the
later one is a ``B-`` label; a span's label is its first token's label without the ``B-``/
``I-`` prefix, its score the mean of its tokens' scores, its word the tokens joined back by
the tokenizer's decoder, its start and end the first and last tokens' character offsets;
spans labelled ``O`` are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding

from vllm_srun.runtime.errors import RuntimeFault

IGNORED_LABELS = ("O",)


@dataclass(frozen=True)
class EntitySpan:
    entity_group: str
    score: float
    word: str
    start: int  # character offsets into the input text
    end: int


@dataclass(frozen=True)
class _Token:
    label: str
    score: np.float32
    word: str
    start: int
    end: int


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float32 as the pipeline computes it."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _tag(label: str) -> tuple[str, str]:
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def entity_spans(text: str, encoding: Encoding, logits: np.ndarray, labels: Sequence[str],
                 unk_id: int | None, join: Callable[[list[str]], str]) -> list[EntitySpan]:
    """Spans of one input: ``encoding`` is its tokenization, ``logits`` float32
    [tokens, labels] (at least as many rows as tokens), ``join`` turns tokens into text."""
    if logits.shape[0] < len(encoding.ids):
        raise RuntimeFault(f"the worker answered {logits.shape[0]} token rows for an input of "
                           f"{len(encoding.ids)} tokens (a different tokenizer?)")
    scores = softmax(np.asarray(logits[: len(encoding.ids)], dtype=np.float32))
    tokens: list[_Token] = []
    for i, (tid, special) in enumerate(zip(encoding.ids, encoding.special_tokens_mask,
                                           strict=True)):
        if special:
            continue
        start, end = encoding.offsets[i]
        best = int(scores[i].argmax())
        word = text[start:end] if tid == unk_id else encoding.tokens[i]
        tokens.append(_Token(labels[best], scores[i][best], word, start, end))
    groups: list[list[_Token]] = []
    for token in tokens:
        bi, tag = _tag(token.label)
        if groups and bi != "B" and tag == _tag(groups[-1][-1].label)[1]:
            groups[-1].append(token)
        else:
            groups.append([token])
    spans = [EntitySpan(entity_group=g[0].label.split("-", 1)[-1],
                        score=float(np.mean(np.nanmean([t.score for t in g]))),
                        word=join([t.word for t in g]), start=g[0].start, end=g[-1].end)
             for g in groups]
    return [s for s in spans if s.entity_group not in IGNORED_LABELS]


def rerank_order(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Document indices, best score first (ties keep the documents' order), at most top_n."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return [int(i) for i in order[: top_n if top_n is not None else len(order)]]
