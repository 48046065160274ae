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
        out = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), np.float32(1e-9))
    out = np.ascontiguousarray(out, dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, np.float32(1e-12))
    return out.astype(np.float32, copy=False)
