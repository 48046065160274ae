"""The API key (R7.1, issue 11 item 4): one Bearer key guards every ``/v1/`` path, wherever
the front end runs (``vllm-srun serve``, a Kubernetes pod, a Ray Serve replica), read from
``--api-key`` or ``VLLM_SRUN_API_KEY`` and compared in constant time. An attached endpoint's own
key is read from the environment variable its ``api_key_env`` names (``server/config.py``)."""

from __future__ import annotations

import hmac
import os

import orjson

from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.worker.protocol import error_body

API_KEY_ENV = "VLLM_SRUN_API_KEY"


def api_key(flag: str | None) -> str | None:
    """The API key from --api-key, else $VLLM_SRUN_API_KEY; None when neither is set."""
    source, key = ("--api-key", flag) if flag is not None else (API_KEY_ENV,
                                                                os.environ.get(API_KEY_ENV))
    if key is None or (source == API_KEY_ENV and key == ""):
        return None
    if len(key) < 8 or not all(33 <= ord(c) <= 126 for c in key):
        raise ConfigError(f"{source} must be at least 8 visible ASCII characters (no spaces)")
    return key


OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})


class RequireApiKey:
    """ASGI guard: every path but ``OPEN_PATHS`` (``/v1/...`` and the peers' routes, R7.5)
    needs ``Authorization: Bearer <key>``, compared in constant time. ``/health`` (probes),
    ``/metrics`` (scrapes) and the OpenAPI document stay open; they carry no inference and no
    inventory."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + key.encode()

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _route(scope) not in OPEN_PATHS \
                and not self.allows(scope["headers"]):
            body = orjson.dumps(error_body(
                "unauthorized", "missing or wrong API key: send 'Authorization: Bearer "
                                "<key>' (see --api-key / VLLM_SRUN_API_KEY)"))
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _route(scope) -> str:
    """The path below the app's mount point (Ray Serve's route prefix, if any)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
