"""The one table from the pool's and the runtime's errors to HTTP (R7.2): status, code and
headers. Every error answer of the API goes through :func:`http_error`.

Bodies are ``{"error": {"code", "message"}}``: 400 invalid request, 401 unauthorized, 404
unknown model, 413 too large, 422 unsupported, 424 not available from this model (TEI's
routes, as TEI answers: a model of another task, ``/embed_all``, ``/embed_sparse``), 429
overloaded, 503 not ready or a failed replica, 504 deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.server.pool.errors import ExchangeError, PoolError

REPLICA_HEADER = "x-vllm-srun-replica"
_RETRY = {"Retry-After": "1"}

CODE_TO_STATUS: dict[str, int] = {
    "invalid_request": 400, "invalid_json": 400,
    "unauthorized": 401,
    "model_not_found": 404, "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "unsupported": 422,
    "not_available": 424,
    "overloaded": 429,
    "internal_error": 500,
    "replica_error": 502,
    "not_ready": 503, "replica_failed": 503, "replica_unavailable": 503,
    "replica_unauthorized": 503,
    "deadline_exceeded": 504,
}
CODE_TO_HEADERS: dict[str, dict[str, str]] = {"overloaded": _RETRY, "not_ready": _RETRY}


class ApiError(Exception):
    """An error the front end itself finds in a request (before any replica sees it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class HttpError:
    status: int
    code: str
    message: str
    headers: dict[str, str] | None


def http_error(exc: ApiError | PoolError | ExchangeError | RuntimeFault) -> HttpError:
    """The answer to give for ``exc``, from the one table."""
    code = exc.code
    message = exc.message if isinstance(exc, ApiError | PoolError | ExchangeError) else str(exc)
    headers = dict(CODE_TO_HEADERS.get(code, {}))
    if isinstance(exc, ExchangeError) and exc.replica_id:
        headers[REPLICA_HEADER] = exc.replica_id
    return HttpError(CODE_TO_STATUS.get(code, 500), code, message, headers or None)
