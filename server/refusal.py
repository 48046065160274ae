"""Overload refusals at the HTTP protocol (R5.3, issue 11 item 6).

When every replica is full, clients that ignore ``Retry-After`` resend at once, so the front
end may refuse thousands of requests a second while the worker shares its cores (and, for the
in-process shorthand, its interpreter). Each refusal must then cost as little as possible:
this protocol answers an inference request's prebuilt 429 as soon as its headers are parsed,
before uvicorn builds an ASGI scope, a task and a request cycle for it. Everything else (and
every request while a replica has room) goes through uvicorn's own protocol unchanged; the
ASGI ``AdmissionGate`` stays as the same rule for servers that do not use this protocol
(Ray Serve's proxy).

Invariant: a refusal is written only when no earlier request of the connection is still being
answered (HTTP/1.1 answers in order); otherwise uvicorn queues it as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_ANSWERED = SimpleNamespace(response_complete=True)  # stands for a cycle that is finished


def refusing_protocol(should_refuse: Callable[[bytes, list], bool], body: bytes,
                      on_refusal: Callable[[bytes], None]) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class that answers 429 with ``body`` when
    ``should_refuse(raw_path, headers)`` holds, calling ``on_refusal(raw_path)`` for the
    metrics."""
    head = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n")
    keep = head + b"\r\n" + body
    close = head + b"connection: close\r\n\r\n" + body

    class RefusingProtocol(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            path = self.url.split(b"?", 1)[0]
            idle = self.cycle is None or self.cycle.response_complete
            if not (idle and should_refuse(path, self.headers)):
                return super().on_headers_complete()
            on_refusal(path)
            self.cycle = _ANSWERED  # the body that follows is read and dropped
            if self.parser.should_keep_alive():
                self.transport.write(keep)
                self.on_response_complete()
            else:
                self.transport.write(close)
                self.transport.close()

    return RefusingProtocol
