"""Golden inputs of the start-up check (R4.3) and the artifacts' reference outputs.

Reference outputs ship for the built-in L6 model (computed with sentence-transformers, the
model's reference library); other artifacts store their first golden answer unchecked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.ledger import output_bits
from vllm_srun.tuner.persistence import RecordSync

GOLDEN_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Thread counts may change how sums are split, and so the last bit of an answer. " * 3,
    "search: how do I learn the fastest thread count for each input size?",
)
_REFERENCE = Path(__file__).with_name("golden_reference.json")
Forward = Callable[[TokenBatch, int], ForwardResult]


def golden_rows(tokenizer: Tokenizer) -> list[list[int]]:
    return tokenizer.encode(GOLDEN_TEXTS, truncate=True)


def reference_outputs(revision: str) -> np.ndarray | None:
    """float32 [len(GOLDEN_TEXTS), dim] for a known artifact revision, else None."""
    try:
        table = json.loads(_REFERENCE.read_text())
    except (OSError, ValueError):
        return None
    entry = table.get(revision)
    if entry is None:
        return None
    flat = np.frombuffer(base64.b64decode(entry["float32_le"]), "<f4")
    return flat.reshape(entry["shape"]).astype(np.float32)


FLOAT32_TOLERANCE = 1e-5  # sentence-transformers' answers, at float32 (README)


def reference_tolerance(precision: str, min_cosine: float) -> float:
    """How far (largest element difference) answers at ``precision`` may lie from the float32
    reference: 1e-5 at float32; at a reduced precision the quality gate's own bound, the
    distance of two unit vectors whose cosine is ``min_cosine``: sqrt(2 (1 - min_cosine))
    (the reference outputs are normalized embeddings)."""
    if precision == "float32":
        return FLOAT32_TOLERANCE
    return max(FLOAT32_TOLERANCE, math.sqrt(2.0 * (1.0 - min_cosine)))


def golden_digest(outputs: np.ndarray) -> str:
    """The record's digest of the golden answers: their bits, hashed."""
    return hashlib.sha256(output_bits(outputs).tobytes()).hexdigest()[:32]


def warm_and_check(forward: Forward, rows: list[list[int]], sync: RecordSync,
                   reference: np.ndarray | None, tolerance: float, configured: int,
                   warm_also: Sequence[int] = ()) -> tuple[TokenBatch, str | None]:
    """A warm pass at the configured count (caches out of the comparison), then the golden
    answers there against the record's digest (``check_golden``); where they hold, a warm pass
    at each of ``warm_also``. Returns the first golden batch and why the worker must stay out
    of dispatch, or None."""
    batches = [pad([row]) for row in rows]
    forward(batches[0], configured)
    # flat: per-token answers (token classification) differ in length per input; the
    # bytes, and so the digest, of vector answers are unchanged by flattening
    outputs = np.concatenate([forward(b, configured).outputs.reshape(-1) for b in batches])
    why = check_golden(outputs, sync, reference, tolerance, configured)
    if why is None:
        for n in warm_also:
            forward(batches[0], n)
    return batches[0], why


def check_golden(outputs: np.ndarray, sync: RecordSync, reference: np.ndarray | None,
                 tolerance: float, configured: int) -> str | None:
    """The golden answers at the configured count against the host record's digest (the
    first worker of a scope stores it, once they pass ``golden_failure``): why they fail,
    or None."""
    scope = sync.scope
    stored = sync.guard("read_golden", lambda rec: rec.golden(scope))
    if (why := golden_failure(outputs, stored, reference, tolerance, configured)) is not None:
        return why
    if stored is None:
        digest = golden_digest(outputs)
        sync.guard("write_golden", lambda rec: rec.put_golden(scope, digest))
    return None


def golden_failure(outputs: np.ndarray, stored: str | None, reference: np.ndarray | None,
                   tolerance: float, configured: int) -> str | None:
    """Why the golden answers at the configured count fail the check (R4.3), or None: with
    no digest stored for the scope yet, against the artifact's ``reference`` outputs (within
    ``tolerance``); else, bit for bit against the ``stored`` digest."""
    if stored is None:
        if reference is not None and (
                err := float(np.abs(outputs - reference.reshape(-1)).max())) > tolerance:
            return (f"golden check failed: answers differ from the artifact's reference "
                    f"outputs by {err:.2e} (tolerance {tolerance:.0e})")
        return None
    if stored != (digest := golden_digest(outputs)):
        return (f"golden check failed: answers at {configured} threads differ from this "
                f"host's record (digest {digest[:12]} vs stored {stored[:12]}); learning and "
                "serving stay off until `vllm-srun threads reset`")
    return None
