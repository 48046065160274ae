"""Reading a request at the HTTP edge: the body within its size limit, its JSON against the
pydantic schema, the inputs, the caller's deadline. Every refusal is an :class:`ApiError`
naming the field; nothing here reaches a worker."""

from __future__ import annotations

import time
from typing import TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from vllm_srun.server.frontend.errors import ApiError
from vllm_srun.server.frontend.schemas import MAX_INPUTS

DEADLINE_HEADER = "x-request-timeout-ms"
M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError("too_large", f"request body is {declared} bytes; limit {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError("too_large", f"request body exceeds {limit} bytes")
    return bytes(body)


def parse(raw: bytes, model: type[M]) -> M:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError("invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
        err = errors[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        if unknown:
            msg = (f"unknown field{'s' if len(unknown) > 1 else ''} "
                   f"{', '.join(repr(u) for u in unknown)}; this route accepts "
                   f"{sorted(model.model_fields)}")
        elif field == "input":
            msg = "input must be a string or a non-empty list of strings"
        else:
            msg = f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
        raise ApiError("invalid_request", msg) from None


def texts_of(value: object, field: str = "input") -> list[str]:
    """The texts of an input field (a string or a list of them), named ``field`` in errors."""
    texts = [value] if isinstance(value, str) else list(value)  # type: ignore[arg-type]
    if not texts:
        raise ApiError("invalid_request", f"{field} must not be an empty list")
    if not all(isinstance(t, str) for t in texts):
        raise ApiError("unsupported", "token-id input is not supported; send text")
    if len(texts) > MAX_INPUTS:
        raise ApiError("too_large", f"{field} has {len(texts)} items; limit {MAX_INPUTS}")
    for i, t in enumerate(texts):
        if not t:
            raise ApiError("invalid_request", f"{field}[{i}] is an empty string")
    return texts


def caller_deadline(request: Request) -> float | None:
    """The caller's own deadline (``X-Request-Timeout-Ms``) as a monotonic time, if any."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ApiError("invalid_request",
                       f"header {DEADLINE_HEADER} must be a positive integer, got {raw!r}")
    return time.monotonic() + int(raw) / 1000
