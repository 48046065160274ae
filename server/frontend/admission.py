"""Overload refused early (R5.3, issue 11 item 6): the admission rule and its two enforcers.

When every replica is full, clients that ignore ``Retry-After`` resend at once, so the front
end may refuse thousands of requests a second while the worker shares its cores (and, for the
in-process shorthand, its interpreter). Each refusal must then cost as little as possible:

- :meth:`Admission.protocol` is a uvicorn HTTP protocol that answers an inference request's
  prebuilt 429 as soon as its headers are parsed, before uvicorn builds an ASGI scope, a task
  and a request cycle for it (``vllm-srun serve`` runs it);
- :meth:`Admission.gate` is the same rule as ASGI middleware, for servers that run our app
  behind their own HTTP layer (Ray Serve's proxy).

Each refusal carries an ``x-request-id`` (the caller's, if valid, else a new one), as every
other answer does (``tracing.py``).

``HttpToolsProtocol`` is uvicorn's private API (it has no public hook that answers before
the ASGI cycle): pyproject.toml pins the uvicorn versions checked, and
tests/test_uvicorn_seam.py names what moved when a release changes what is overridden here.

Invariants: a refusal is written only when no earlier request of the connection is still being
answered (HTTP/1.1 answers in order); a caller the API key refuses gets its 401, not a 429.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vllm_srun.server.pool.dispatch import MAX_IN_FLIGHT
from vllm_srun.server.worker.protocol import error_body
from vllm_srun.server.worker.trace import new_request_id, valid_request_id

# stands for a request cycle that is finished (all that uvicorn's protocol reads of one)
_ANSWERED = SimpleNamespace(response_complete=True, disconnected=False, keep_alive=True,
                            message_event=SimpleNamespace(set=lambda: None))

Headers = list[tuple[bytes, bytes]]


class Admission:
    PATHS = frozenset((b"/v1/embeddings", b"/v1/classify", b"/v1/rerank",  # and R7.5's:
                       b"/embed", b"/rerank", b"/predict", b"/similarity", b"/embeddings",
                       b"/classify"))

    def __init__(self, saturated: Callable[[], bool], count: Callable[[str], None],
                 allows: Callable[[Headers], bool] | None = None) -> None:
        self._saturated, self._count, self._allows = saturated, count, allows
        self.body = orjson.dumps(error_body(
            "overloaded", f"every ready replica has {MAX_IN_FLIGHT} requests in flight"))

    def refuses(self, path: bytes, headers: Headers) -> bool:
        """An inference path, from a caller the key allows, while no replica can admit."""
        return path in self.PATHS and self._saturated() and (
            self._allows is None or self._allows(headers))

    def count(self, path: bytes) -> None:
        self._count(path.decode().rsplit("/", 1)[-1])

    def gate(self, app):
        """ASGI middleware enforcing the rule in front of ``app``."""
        admission = self

        async def gated(scope, receive, send) -> None:
            if scope["type"] == "http" and admission.refuses(
                    path := scope["path"].encode(), scope["headers"]):
                admission.count(path)
                await send({"type": "http.response.start", "status": 429, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(admission.body)).encode()),
                    (b"retry-after", b"1")]})
                await send({"type": "http.response.body", "body": admission.body})
                return
            await app(scope, receive, send)

        return gated

    def protocol(self) -> type[HttpToolsProtocol]:
        """A uvicorn HTTP protocol class that refuses per the rule at header time."""
        head = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                b"retry-after: 1\r\ncontent-length: " + str(len(self.body)).encode() + b"\r\n")
        keep, close = b"\r\n" + self.body, b"connection: close\r\n\r\n" + self.body
        admission = self

        def with_id(headers: Headers) -> bytes:  # the caller's id if valid, else a new one
            given = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"),
                         None)
            rid = given if valid_request_id(given) else new_request_id()
            return head + b"x-request-id: " + rid.encode() + b"\r\n"

        class RefusingProtocol(HttpToolsProtocol):
            def on_headers_complete(self) -> None:
                path = self.url.split(b"?", 1)[0]
                idle = self.cycle is None or self.cycle.response_complete
                if not (idle and admission.refuses(path, self.headers)):
                    return super().on_headers_complete()
                admission.count(path)
                self.cycle = _ANSWERED  # the body that follows is read and dropped
                if self.parser.should_keep_alive():
                    self.transport.write(with_id(self.headers) + keep)
                    self.on_response_complete()
                else:
                    self.transport.write(with_id(self.headers) + close)
                    self.transport.close()

        return RefusingProtocol
