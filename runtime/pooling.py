"""Pooling token embeddings into one vector per row (sentence-transformers' definitions)."""

from __future__ import annotations

import numpy as np

from vllm_srun.runtime.types import Pooling


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling, normalize: bool) -> np.ndarray:
    """hidden float32 [rows, tokens, dim], mask int [rows, tokens] -> float32 [rows, dim]."""
    m = mask.astype(np.float32)[:, :, None]
    if pooling is Pooling.CLS:
        out = hidden[:, 0, :]
    elif pooling is Pooling.MAX:
        out = np.where(m > 0, hidden, np.float32(-1e9)).max(axis=1)
    else:
        # accumulate in float64: numpy sums a strided axis one token after another, so a
        # float32 sum over 8,192 tokens drifts by ~1e-4 (torch's, and so
        # sentence-transformers', stays within ~1e-6)
        out = (hidden * m).sum(axis=1, dtype=np.float64) / np.maximum(
            m.sum(axis=1, dtype=np.float64), 1e-9)
    out = np.ascontiguousarray(out, dtype=np.float32)
    return l2_normalize(out) if normalize else out


def l2_normalize(rows: np.ndarray) -> np.ndarray:
    """Each float32 row over its L2 norm (sentence-transformers' Normalize module)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.maximum(norms, np.float32(1e-12))).astype(np.float32, copy=False)
