"""The pool's errors. No HTTP here: the front end's one table (``frontend/errors.py``) turns
each into a status, a code and headers.

    PoolError        the pool could not place a request (``Refusal`` says why)
    ExchangeError    a replica's exchange ended without an answer (``Outcome`` says how, for
                     the outlier policy; ``code`` is the R7.2 code the caller sees)
"""

from __future__ import annotations

import enum

from vllm_srun.server.pool.outlier import Outcome


class Refusal(enum.StrEnum):
    OVERLOADED = "overloaded"          # every ready replica is full (R5.3)
    NOT_READY = "not_ready"            # no ready replica, or the pool is starting
    UNKNOWN_MODEL = "model_not_found"  # the request names no served model


class PoolError(Exception):
    def __init__(self, refusal: Refusal, message: str) -> None:
        super().__init__(message)
        self.refusal, self.message = refusal, message

    @property
    def code(self) -> str:
        return self.refusal.value


class ExchangeError(Exception):
    def __init__(self, outcome: Outcome, code: str, message: str,
                 retry_elsewhere: bool = False) -> None:
        super().__init__(message)
        self.outcome, self.code, self.message = outcome, code, message
        self.retry_elsewhere = retry_elsewhere  # nothing was done: another replica may try
        self.replica_id: str | None = None  # who answered with this error, once dispatched
