"""Shared vocabulary of the runtime: small frozen dataclasses and enums that cross seams."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class Task(enum.StrEnum):
    EMBED = "embed"  # one pooled vector per row
    CLASSIFY = "classify"  # sequence classification: one row of label logits per row
    TOKEN_CLASSIFY = "token_classify"  # label logits per token (entity spans, R7.4)
    RERANK = "rerank"  # cross-encoder: a (query, document) pair per row -> one score (R7.4)


TextInput = str | tuple[str, str]  # a text, or a text pair (query, document) for a reranker


def input_chars(inputs: Sequence[TextInput]) -> int:
    """Characters in a request's inputs (a pair counts both texts)."""
    return sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in inputs)


class Pooling(enum.StrEnum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"


class BackendName(enum.StrEnum):
    ONNXRUNTIME = "onnxruntime"
    TORCH = "torch"


@dataclass(frozen=True)
class Manifest:
    """What an artifact is. ``revision`` is a content digest of the weights."""

    name: str
    path: str
    revision: str
    task: Task
    pooling: Pooling
    normalize: bool
    max_tokens: int
    hidden_size: int
    tokenizer_path: str
    safetensors_path: str | None = None
    onnx_path: str | None = None
    labels: tuple[str, ...] = ()
    sigmoid: bool = False  # rerank: scores are sigmoid(logit) (CrossEncoder's one-label default)
    # sentence-transformers' prompts (name -> text put before an input) and the one applied
    # when a request names none (config_sentence_transformers.json)
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None


@dataclass(frozen=True)
class TokenBatch:
    """A padded forward input: ``input_ids`` and ``attention_mask`` are int64 [rows, tokens];
    ``token_type_ids`` (same shape) only when rows are text pairs, else the model's zeros."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray | None = None
    # bool [rows]: rows answered before the model's last step (no Normalize, no sigmoid);
    # None: none
    raw_rows: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        """Input size of the forward: rows x padded length."""
        return int(self.input_ids.size)


@dataclass(frozen=True)
class ForwardResult:
    """The output of one forward: one vector per row, and what actually ran it."""

    outputs: np.ndarray  # float32 [rows, dim] (pooled embeddings, logits, scores) or, for
    # token classification, [rows, tokens, labels] logits
    num_threads: int  # the count the forward stated
    observed_threads: int  # the count observed from inside the forward
    forward_s: float
    # seconds its threads spent runnable but not running, summed (another task had their
    # CPU: its time is not the count's); None where not measured
    waited_s: float | None = None


@dataclass(frozen=True)
class EngineArgs:
    """Engine arguments of a deployment. Units in names."""

    num_threads: int
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    timeout_ms: int = 30_000
    cache_entries: int = 4096
    # forwards a worker runs at once, each at ``num_threads`` (with adaptive threads, a
    # forward takes a count above it only where it fits beside the others running)
    concurrent_forwards: int = 1


@dataclass(frozen=True)
class ForwardRecord:
    """What the engine reports after each served forward (metrics, tuner)."""

    rows: int
    padded_tokens: int
    num_threads: int
    observed_threads: int
    forward_s: float
    requests: int = 1
