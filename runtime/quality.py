"""The quality gate (R1.5): before a reduced precision serves, its answers on a fixed set of
real texts are compared with float32's, per task:

- embeddings: the minimum cosine similarity of a text's vectors (``min_cosine``);
- classifiers: label agreement (``min_label_agreement``) and the largest difference of a
  class probability (``max_prob_diff``, reported; a threshold only when set);
- rerank: the share of document pairs per query ranked in the same order
  (``min_order_agreement``);
- token classification: the share of entity spans (label, first and last token) found by
  both, over those found by either (``min_span_agreement``).

Figures are pure functions of the two precisions' outputs; ``verdict`` says why a precision
is refused (the figure, its measured value and the threshold), or None. Every task also
counts the evaluation texts whose answer holds a value that is not finite (NaN or infinity,
``non_finite``): any such text refuses the precision, since a NaN compares false with every
threshold and an argmax still picks a label from a NaN row.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.tasks import softmax
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import Manifest, Task, TokenBatch

_TEXTS = Path(__file__).with_name("eval_texts.json")
BATCH_ROWS = 8  # rows per gate forward: batched as the engine batches, padding included
QUERIES = 4  # rerank: the first (shortest) texts are queries, the longest the documents


@dataclass(frozen=True)
class GateThresholds:
    """The figures a reduced precision must reach. Defaults follow the upstream runtime's
    rule for an int8 CPU copy (cosine 0.999, 99% label agreement)."""

    min_cosine: float = 0.999
    min_label_agreement: float = 0.99
    max_prob_diff: float | None = None  # reported always; refused only when set
    min_order_agreement: float = 0.99
    min_span_agreement: float = 0.99

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"quality_gate.{key} must be within 0..1, got {value}")


@dataclass(frozen=True)
class QualityFigures:
    """A precision's answers against float32's on the evaluation set (None: not this task)."""

    texts: int
    min_cosine: float | None = None
    label_agreement: float | None = None
    max_prob_diff: float | None = None
    order_agreement: float | None = None
    span_agreement: float | None = None
    non_finite: int = 0  # texts whose answer holds a NaN or an infinity

    def to_dict(self) -> dict:
        return {k: (round(v, 8) if isinstance(v, float) else v)
                for k, v in asdict(self).items() if v is not None}


def eval_texts() -> list[str]:
    return list(json.loads(_TEXTS.read_text())["texts"])


def gate_batches(manifest: Manifest, tokenizer: Tokenizer) -> list[TokenBatch]:
    """The evaluation set as padded batches: texts (rerank: each query with each document),
    ordered by length and cut at the model's limit."""
    texts = eval_texts()
    inputs: list = texts
    if manifest.task is Task.RERANK:
        inputs = [(q, d) for q in texts[:QUERIES] for d in texts[-BATCH_ROWS:]]
    rows = tokenizer.rows(inputs, truncate=True)
    order = range(len(rows.ids)) if manifest.task is Task.RERANK else \
        sorted(range(len(rows.ids)), key=lambda i: len(rows.ids[i]))
    order = list(order)
    batches = []
    for at in range(0, len(order), BATCH_ROWS):
        chosen = order[at: at + BATCH_ROWS]
        types = [rows.type_ids[i] for i in chosen] if rows.type_ids else None
        batches.append(pad([rows.ids[i] for i in chosen], types))
    return batches


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _order_agreement(ref: np.ndarray, got: np.ndarray, groups: int) -> float:
    """Document pairs ranked the same way within each query's scores (ties as ties)."""
    same = total = 0
    for r, g in zip(ref.reshape(groups, -1), got.reshape(groups, -1), strict=True):
        for i in range(len(r)):
            for j in range(i + 1, len(r)):
                total += 1
                same += int(np.sign(r[i] - r[j]) == np.sign(g[i] - g[j]))
    return same / total if total else 1.0


def _spans(labels_of_tokens: np.ndarray, names: tuple[str, ...]) -> set[tuple[str, int, int]]:
    """Entity spans of one input's argmax labels (``tasks.entity_spans``' grouping rule)."""
    spans, current = set(), None
    for i, k in enumerate(labels_of_tokens):
        label = names[int(k)] if names else str(int(k))
        bi, tag = ("B", label[2:]) if label.startswith("B-") else (
            ("I", label[2:]) if label.startswith("I-") else ("I", label))
        if current is not None and bi != "B" and tag == current[0]:
            current = (tag, current[1], i)
            continue
        if current is not None and current[0] != "O":
            spans.add(current)
        current = (tag, i, i)
    if current is not None and current[0] != "O":
        spans.add(current)
    return spans


def figures(manifest: Manifest, batches: list[TokenBatch], reference: list[np.ndarray],
            candidate: list[np.ndarray]) -> QualityFigures:
    """The task's figures of ``candidate`` outputs against ``reference`` (float32) ones,
    batch by batch as ``gate_batches`` made them."""
    bad = sum(non_finite_rows(b, got) for b, got in zip(batches, candidate, strict=True))
    return replace(_figures(manifest, batches, reference, candidate), non_finite=bad)


def non_finite_rows(batch: TokenBatch, got: np.ndarray) -> int:
    """Rows of one batch's answer that hold a value that is not finite."""
    return int((~np.isfinite(got.reshape(batch.rows, -1))).any(-1).sum())


def _figures(manifest: Manifest, batches: list[TokenBatch], reference: list[np.ndarray],
             candidate: list[np.ndarray]) -> QualityFigures:
    task = manifest.task
    if task is Task.TOKEN_CLASSIFY:
        both = either = 0
        agree = tokens = 0
        for b, ref, got in zip(batches, reference, candidate, strict=True):
            for row in range(b.rows):
                n = int(b.attention_mask[row].sum())
                r, g = ref[row, 1: n - 1].argmax(-1), got[row, 1: n - 1].argmax(-1)
                agree, tokens = agree + int((r == g).sum()), tokens + len(r)
                a, c = _spans(r, manifest.labels), _spans(g, manifest.labels)
                both, either = both + len(a & c), either + len(a | c)
        return QualityFigures(sum(b.rows for b in batches),
                              label_agreement=agree / max(tokens, 1),
                              span_agreement=both / either if either else 1.0)
    ref, got = np.concatenate(reference), np.concatenate(candidate)
    texts = len(ref)
    if task is Task.EMBED:
        return QualityFigures(texts, min_cosine=float((_unit(ref) * _unit(got)).sum(-1).min()))
    if task is Task.RERANK:
        return QualityFigures(texts, order_agreement=_order_agreement(ref, got, QUERIES))
    p_ref, p_got = softmax(ref.astype(np.float64)), softmax(got.astype(np.float64))
    return QualityFigures(texts, label_agreement=float((ref.argmax(-1) == got.argmax(-1)).mean()),
                          max_prob_diff=float(np.abs(p_ref - p_got).max()))


_CHECKS = (("min_cosine", "min_cosine", True), ("label_agreement", "min_label_agreement", True),
           ("max_prob_diff", "max_prob_diff", False),
           ("order_agreement", "min_order_agreement", True),
           ("span_agreement", "min_span_agreement", True))


def verdict(measured: QualityFigures, thresholds: GateThresholds) -> str | None:
    """Why the precision is refused (non-finite answers, or the first figure past its
    threshold), or None."""
    if measured.non_finite:
        return (f"quality gate: {measured.non_finite} of {measured.texts} evaluation texts "
                "answered NaN or infinity (non_finite)")
    for figure, key, at_least in _CHECKS:
        value, limit = getattr(measured, figure), getattr(thresholds, key)
        if value is None or limit is None:
            continue
        if (value < limit) if at_least else (value > limit):
            side = "below" if at_least else "above"
            return (f"quality gate: {figure} {value:.8f} is {side} the threshold "
                    f"quality_gate.{key} {limit} (against float32 on {measured.texts} "
                    "evaluation texts)")
    return None
