"""One HTTP exchange with a replica (a worker's socket or an attached endpoint), and how it
ended: an answer, or an :class:`ExchangeError` whose ``Outcome`` feeds the outlier policy and
whose ``code`` is what the caller is told."""

from __future__ import annotations

import time

import httpx

from vllm_srun.server.pool.errors import ExchangeError
from vllm_srun.server.pool.outlier import Outcome

GRACE_S = 0.05            # beyond the deadline before the pool gives up on the worker itself
PROBE_TIMEOUT_S = 1.0

# codes a replica may pass on to the caller as they are (its answer to the request itself)
_CALLER_CODES = {"invalid_request", "invalid_json", "too_large", "unsupported",
                 "model_not_found"}
_STATUS_TO_CODE = {400: "invalid_request", 404: "model_not_found", 413: "too_large",
                   422: "unsupported"}


def refused_key(sent: bool, status: int) -> str:
    if sent:
        return (f"endpoint refused the API key from api_key_env ({status}): the variable holds "
                f"a key the endpoint does not accept")
    return (f"endpoint requires an API key ({status}): set api_key_env on this replica to an "
            f"environment variable holding it")


def exchange_error(replica_id: str, resp: httpx.Response, sent_key: bool) -> ExchangeError:
    """How a replica's non-200 answer ended the exchange."""
    try:
        err = resp.json()["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "replica_error", resp.text[:200]
    status = resp.status_code
    if status in (401, 403):  # the endpoint refused *our* key: not the caller's fault
        return ExchangeError(Outcome.FAILURE, "replica_unauthorized",
                             f"replica {replica_id}: {refused_key(sent_key, status)}")
    if status == 504:
        return ExchangeError(Outcome.TIMEOUT, "deadline_exceeded",
                             f"replica {replica_id}: {message}")
    if status in (429, 503):
        return ExchangeError(Outcome.REFUSED, "not_ready",
                             f"replica {replica_id} refused: {message}", retry_elsewhere=True)
    if 400 <= status < 500:
        known = code if code in _CALLER_CODES else _STATUS_TO_CODE.get(status, "replica_error")
        return ExchangeError(Outcome.NEUTRAL, known, message)
    return ExchangeError(Outcome.FAILURE, "replica_failed",
                         f"replica {replica_id} failed: {message}")


async def post(replica_id: str, client: httpx.AsyncClient, path: str, payload: bytes,
               headers: dict[str, str], deadline: float) -> httpx.Response:
    """POST with the deadline as the limit; transport faults become ExchangeErrors."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:  # no exchange: it neither counts nor resets (R5.5)
        raise ExchangeError(Outcome.NOT_SENT, "deadline_exceeded",
                            "deadline passed before the request was sent")
    try:
        return await client.post(path, content=payload, headers=headers,
                                 timeout=httpx.Timeout(remaining + GRACE_S,
                                                       connect=min(remaining, 1.0)))
    except httpx.ConnectError as exc:
        raise ExchangeError(Outcome.FAILURE, "replica_unavailable",
                            f"replica {replica_id} cannot be reached: {exc}",
                            retry_elsewhere=True) from None
    except httpx.TimeoutException:
        raise ExchangeError(Outcome.TIMEOUT, "deadline_exceeded",
                            f"replica {replica_id} did not answer within the deadline") from None
    except httpx.TransportError as exc:
        raise ExchangeError(Outcome.FAILURE, "replica_failed",
                            f"replica {replica_id} failed while answering: "
                            f"{type(exc).__name__}: {exc}") from None


async def healthy(client: httpx.AsyncClient) -> bool:
    """One ``/health`` probe: True on 200."""
    try:
        return (await client.get("/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
    except httpx.TransportError:
        return False
