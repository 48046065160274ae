"""Deterministic request inputs: texts where short prompts dominate (median ~60 characters,
long tail), and token-id rows of a served mix of lengths for the in-process benches."""

from __future__ import annotations

import numpy as np

_TEXT = ("the of and to in is for on that with as by it at from this be are an or was but "
         "search query result vector model server thread input token embedding latency "
         "throughput request answer system memory batch length short long kernel host "
         "python record cache route worker engine forward shadow learn count size range")
_WORDS = tuple(_TEXT.split())


def texts(n: int, seed: int = 0, median_chars: int = 60, max_chars: int = 3000) -> list[str]:
    """n unique texts with lognormal lengths (so the result cache never answers them)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median_chars), 0.9, n), 8, max_chars).astype(int)
    out = []
    for i, chars in enumerate(lengths):
        words: list[str] = [f"r{seed}x{i}"]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(_WORDS[int(rng.integers(len(_WORDS)))])
        out.append(" ".join(words))
    return out


def mixed_length(rng: np.random.Generator) -> int:
    """A served input's length in tokens: 70% short (6-23), 25% passages (60-159), 5% long
    (200-255)."""
    u = rng.random()
    return int(rng.integers(6, 24) if u < 0.7 else rng.integers(60, 160) if u < 0.95
               else rng.integers(200, 256))


def token_row(tokens: int, rng: np.random.Generator) -> list[int]:
    """``tokens`` ids: BERT's [CLS] (101), random word-piece ids, [SEP] (102)."""
    return [101, *(int(t) for t in rng.integers(1000, 29000, tokens - 2)), 102]
