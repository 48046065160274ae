"""The wire protocol between the pool and a managed worker: one module both sides import.

HTTP over the worker's owner-only Unix socket (R7.3):

- ``GET /health``: 200 with :func:`health_body` once loaded and checked; 503 with an error body
  while loading (code ``not_ready``) or when a start-up check refused it (``check_failed``).
- ``POST /work``: a JSON :class:`Work` -> ``application/octet-stream`` little-endian float32
  rows, with ``x-rows``, ``x-dim`` and ``x-tokens`` headers; an error is an R7.2 error body.
  A text may be a ``[query, document]`` pair (reranking, R7.4), and ``field`` names the
  inputs in errors; ``raw`` asks for the rows before the model's last step (pooled vectors
  before its Normalize module, a cross-encoder's logit before its sigmoid). Per-token
  answers (token classification) add ``x-len``: the body is ``[x-rows, x-len, x-dim]``,
  each row zero-padded after its own tokens. The front end's ``x-request-id`` goes with the
  request (the worker logs under it); an answer the engine ran carries its ``x-queue-ms``
  and ``x-forward-ms`` (``trace.py``).
- ``GET /threads``: the worker's adaptive-threads report (JSON).
- ``GET /metrics``: the worker's own Prometheus metrics (forward time by size and count).

Errors carry the R7.2 ``code`` the caller will see; the worker's HTTP status only sorts them
for the exchange (input, not ready, deadline, failure): the status a caller gets is the front
end's to choose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

from vllm_srun.runtime.types import TextInput

WORK, HEALTH, THREADS, METRICS = "/work", "/health", "/threads", "/metrics"
CHECK_FAILED = "check_failed"

# how a worker answers each kind of error on the socket (the exchange's classification)
_STATUS = {"not_ready": 503, CHECK_FAILED: 503, "deadline_exceeded": 504,
           "internal_error": 500}


class ProtocolError(ValueError):
    """A message that does not follow this protocol; the text names what is wrong."""


def error_body(code: str, message: str) -> dict:
    """The R7.2 error body: ``{"error": {"code", "message"}}``."""
    return {"error": {"code": code, "message": message}}


def error_status(code: str) -> int:
    """The worker's status for an error: 400 for anything the request got wrong."""
    return _STATUS.get(code, 400)


def _inputs(items: object) -> list[TextInput]:
    """Strings, or [text, text] pairs (a reranker's rows)."""
    if not isinstance(items, list):
        raise ProtocolError("bad worker request: texts must be a list")
    out: list[TextInput] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(t, str)
                                                               for t in item):
            out.append((item[0], item[1]))
        else:
            raise ProtocolError("bad worker request: each of texts must be a string or a "
                                "[text, text] pair")
    return out


@dataclass(frozen=True)
class Work:
    texts: list[TextInput]
    truncate: bool
    timeout_ms: int
    field: str = "input"
    raw: bool = False

    def encode(self) -> bytes:
        return orjson.dumps({"texts": self.texts, "truncate": self.truncate,
                             "timeout_ms": self.timeout_ms, "field": self.field,
                             "raw": self.raw})

    @classmethod
    def decode(cls, body: bytes) -> Work:
        try:
            raw = orjson.loads(body)
            texts, timeout_ms = raw["texts"], int(raw["timeout_ms"])
            truncate, field = bool(raw.get("truncate", False)), str(raw.get("field", "input"))
            before_last = bool(raw.get("raw", False))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad worker request: {exc!r}") from None
        return cls(_inputs(texts), truncate, timeout_ms, field, before_last)


def encode_rows(rows: np.ndarray, tokens: int) -> tuple[bytes, dict[str, str]]:
    rows = rows.astype("<f4", copy=False)
    headers = {"x-rows": str(rows.shape[0]), "x-dim": str(rows.shape[-1]),
               "x-tokens": str(tokens)}
    if rows.ndim == 3:  # per-token answers: [rows, x-len, x-dim]
        headers["x-len"] = str(rows.shape[1])
    return rows.tobytes(), headers


def decode_rows(content: bytes, headers) -> tuple[np.ndarray, int]:
    try:
        n, dim, tokens = (int(headers[k]) for k in ("x-rows", "x-dim", "x-tokens"))
        shape = (n, int(headers["x-len"]), dim) if "x-len" in headers else (n, dim)
        return np.frombuffer(content, dtype="<f4").reshape(shape), tokens
    except (KeyError, ValueError) as exc:
        raise ProtocolError(f"bad worker answer: {exc!r}") from None


def health_body(model: str, revision: str, device: str, pid: int, num_threads: int,
                max_num_seqs: int, max_num_batched_tokens: int,
                precision: dict | None = None) -> dict:
    """``precision``: what serves and why, with the quality gate's figures (R1.5)."""
    return {"status": "ok", "model": model, "revision": revision, "device": device,
            "pid": pid, "num_threads": num_threads,
            "limits": {"max_num_seqs": max_num_seqs,
                       "max_num_batched_tokens": max_num_batched_tokens},
            "precision": precision}
