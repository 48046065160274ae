"""The overload gate's one private dependency (R5.3): ``Admission.protocol()`` subclasses
uvicorn's ``HttpToolsProtocol`` (uvicorn has no public hook that answers before an ASGI
cycle is built). pyproject.toml pins uvicorn to the versions this is checked on; these tests
fail loudly, naming what moved, when a uvicorn release changes the parts the subclass uses,
and then drive the subclass in a real uvicorn server (no model) to see it still answers."""

from __future__ import annotations

import ast
import inspect
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl

from tests.conftest import free_port
from vllm_srun.server.frontend.admission import _ANSWERED, Admission

# what RefusingProtocol.on_headers_complete reads or calls on the protocol
PROTOCOL_ATTRIBUTES = {"url", "headers", "cycle", "parser", "transport"}
# what uvicorn touches on a cycle only after `self.cycle.response_complete` returned early
GUARDED_CYCLE_ATTRIBUTES = {"body", "more_body"}


def _class(source: str) -> ast.ClassDef:
    tree = ast.parse(source)
    return next(n for n in tree.body if isinstance(n, ast.ClassDef)
                and n.name == "HttpToolsProtocol")


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def seam_problems(source: str) -> list[str]:
    """What in this httptools_impl.py source breaks the subclass's assumptions."""
    cls = _class(source)
    methods, problems = _methods(cls), []
    for name in ("on_headers_complete", "on_response_complete"):
        m = methods.get(name)
        if m is None or [a.arg for a in m.args.args] != ["self"]:
            problems.append(f"HttpToolsProtocol.{name}(self) is gone or takes other arguments")
    assigned = {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    if missing := PROTOCOL_ATTRIBUTES - assigned:
        problems.append(f"HttpToolsProtocol no longer sets {sorted(missing)}")
    # on_headers_complete is overridden: it reads only the fresh cycle it builds itself
    on_cycle = {n.attr for name, m in methods.items() if name != "on_headers_complete"
                for n in ast.walk(m) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute) and n.value.attr == "cycle"}
    if extra := on_cycle - set(vars(_ANSWERED)) - GUARDED_CYCLE_ATTRIBUTES:
        problems.append(f"uvicorn reads {sorted(extra)} of a request cycle, which the "
                        f"answered stand-in (_ANSWERED) lacks")
    for name in ("on_body", "on_message_complete"):
        first = methods[name].body[0] if name in methods else None
        if not (isinstance(first, ast.If) and "response_complete" in ast.unparse(first.test)
                and isinstance(first.body[0], ast.Return)):
            problems.append(f"HttpToolsProtocol.{name} no longer returns first when the "
                            f"cycle's response is complete")
    return problems


def test_uvicorn_private_api_the_gate_subclasses_is_unchanged():
    assert seam_problems(inspect.getsource(httptools_impl)) == [], (
        f"uvicorn {uvicorn.__version__} changed HttpToolsProtocol; update "
        "server/frontend/admission.py and the pin in pyproject.toml")


def test_uvicorn_is_pinned_to_the_checked_versions():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"uvicorn>=([\d.]+),<([\d.]+)"', text)
    assert pin is not None, "pyproject.toml must pin uvicorn to a checked range"
    have = tuple(int(x) for x in uvicorn.__version__.split(".")[:2])
    low, high = (tuple(int(x) for x in v.split(".")[:2]) for v in pin.groups())
    assert low <= have < high


@pytest.fixture(scope="module")
def gate_server():
    """A real uvicorn server on the refusing protocol: a tiny app, and a rule that refuses
    every inference path."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"3")]})
        await send({"type": "http.response.body", "body": b"app"})

    counted: list[str] = []
    admission = Admission(lambda: True, counted.append)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           http=admission.protocol(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started and time.monotonic() < end:
        time.sleep(0.01)
    yield port, counted
    server.should_exit = True
    thread.join(timeout=10)


def _exchange(port: int, raw: bytes, answers: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while data.count(b"HTTP/1.") < answers or not data.endswith((b"}", b"app")):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_the_subclass_refuses_inference_and_passes_the_rest_on(gate_server):
    port, counted = gate_server
    post = (b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 13\r\n\r\n{\"input\":\"a\"}")
    get = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    data = _exchange(port, post + post + get, 3)  # pipelined: answered in order
    assert data.count(b"HTTP/1.1 429 Too Many Requests") == 2, data
    assert data.index(b"429") < data.rindex(b"200 OK") and data.endswith(b"app")
    assert counted[-2:] == ["embeddings", "embeddings"]
    closed = _exchange(port, post.replace(b"HTTP/1.1", b"HTTP/1.0"), 1)
    assert b"429" in closed and b"connection: close" in closed


@pytest.mark.parametrize("old,new,problem", [
    ("def on_response_complete(self)", "def on_response_done(self)", "on_response_complete"),
    ("def on_headers_complete(self)", "def on_headers_complete(self, parser)",
     "on_headers_complete"),
    ("self.url = ", "self.target = ", "no longer sets ['url']"),
    ("self.cycle.keep_alive = False", "self.cycle.keep_alive = self.cycle.ready",
     "reads ['ready'] of a request cycle")])
def test_the_check_names_a_changed_uvicorn(old, new, problem):
    """The check itself: a uvicorn changed in each way the subclass depends on is caught."""
    source = inspect.getsource(httptools_impl)
    assert old in source
    problems = seam_problems(source.replace(old, new))
    assert any(problem in p for p in problems), problems
