"""Overload refused at the HTTP protocol (R5.3, issue 11 item 6): while every replica is full,
inference requests get their prebuilt 429 before uvicorn builds an ASGI cycle for them, with
the same answers HTTP clients rely on: in order on a kept-alive connection, closed after an
HTTP/1.0 request, and a 401 (not a 429) for a caller without the API key. A worker whose
forward hangs holds 32 requests in flight: a real, full pool."""

from __future__ import annotations

import socket
import threading

import httpx
import orjson
import pytest

from tests.conftest import Server, cpu_deployment, wait_until, write_config

KEY = "overload-key-1"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    faults = tmp / "faults"
    faults.mkdir()
    config = write_config(tmp / "c.yaml", {"primary": cpu_deployment(1, timeout_ms=60_000)})
    server = Server("--config", str(config), env={"VLLM_SRUN_API_KEY": KEY},
                    faults=faults).wait_ready()
    auth = {"authorization": f"Bearer {KEY}"}
    (faults / "all").write_text("hang")
    hung = [threading.Thread(target=lambda i=i: httpx.post(
        server.url + "/v1/embeddings", json={"input": f"held {i}"}, headers=auth, timeout=90))
        for i in range(32)]
    for t in hung:
        t.start()
    wait_until(lambda: server.client.get("/v1/inventory", headers=auth).json()[
        "deployments"][0]["replicas"][0]["in_flight"] == 32, 60, "32 requests in flight")
    yield server, auth
    (faults / "all").unlink()
    for t in hung:
        t.join(timeout=90)
    server.close()
    errors = server.proc.stderr.read()
    assert "Traceback" not in errors, errors[-3000:]  # e.g. a refused connection's close


def raw(url: str, payload: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
            if payload.startswith(b"POST") and b"HTTP/1.0" not in payload and \
                    b"".join(chunks).count(b"HTTP/1.1 ") >= payload.count(b"POST "):
                break
        return b"".join(chunks)


def request(key: str | None, version: str = "1.1", body: bytes = b'{"input": "x"}') -> bytes:
    head = f"POST /v1/embeddings HTTP/{version}\r\nhost: t\r\ncontent-type: application/json" \
           f"\r\ncontent-length: {len(body)}\r\n"
    if key:
        head += f"authorization: Bearer {key}\r\n"
    return head.encode() + b"\r\n" + body


def test_a_full_pool_refuses_at_once_with_retry_after(full):
    server, auth = full
    r = server.client.post("/v1/embeddings", json={"input": "one more"}, headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    # the prebuilt refusal carries a request id too: the caller's, or a new one
    assert len(r.headers["x-request-id"]) == 32
    r = server.client.post("/v1/embeddings", json={"input": "one more"},
                           headers={**auth, "x-request-id": "mine-1"})
    assert r.status_code == 429 and r.headers["x-request-id"] == "mine-1"
    assert server.client.get("/health").status_code == 200  # probes still answered


def answers(url: str, payload: bytes, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``payload`` in one write (so the server parses every request of it before it
    answers any) and read ``n`` answers off the connection, in order: (status, headers,
    body)."""
    host, port = url.removeprefix("http://").split(":")
    got, buf = [], b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        while len(got) < n:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                status_line, *lines = head.decode("latin-1").split("\r\n")
                headers = {k.lower(): v for k, v in (x.split(": ", 1) for x in lines)}
                length = int(headers["content-length"])
                if len(rest) >= length:
                    got.append((int(status_line.split()[1]), headers, rest[:length]))
                    buf = rest[length:]
                    continue
            data = s.recv(65536)
            assert data, f"connection closed after {len(got)} answers: {got} {buf!r}"
            buf += data
    return got


# the two 429s differ: the protocol's prebuilt one (an idle connection) and the pool's (a
# request the protocol let through because an earlier one was still being answered)
PREBUILT = ("overloaded", "every ready replica has 32 requests in flight")
FROM_POOL = ("overloaded", "deployment 'primary': every ready replica has 32 requests in flight")
UNAUTHORIZED = ("unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "(see --api-key / VLLM_SRUN_API_KEY)")


def summary(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, tuple[str, str] | None]:
    status, _headers, body = answer
    error = orjson.loads(body).get("error")
    return status, (error["code"], error["message"]) if error else None


def test_pipelined_answers_come_back_in_request_order(full):
    """R5.3 and HTTP/1.1 pipelining: a refusal is written only while no earlier request of the
    connection is still being answered. Behind a request the app answers (inventory, or a
    401), a POST goes through the app and gets the pool's 429, after the earlier answer; on an
    idle connection it gets the prebuilt 429 at once."""
    server, _ = full
    inventory = f"GET /v1/inventory HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {KEY}\r\n\r\n"
    first = answers(server.url, inventory.encode() + request(KEY), 2)
    assert [summary(a) for a in first] == [(200, None), (429, FROM_POOL)]
    assert orjson.loads(first[0][2])["deployments"][0]["replicas"][0]["in_flight"] == 32

    second = answers(server.url, request(KEY) + request(None) + request(KEY), 3)
    assert [summary(a) for a in second] == [(429, PREBUILT), (401, UNAUTHORIZED),
                                            (429, FROM_POOL)]
    for _status, headers, _body in (first[1], *second):
        assert "connection" not in headers  # kept alive throughout
    assert [h.get("retry-after") for _s, h, _b in second] == ["1", None, "1"]


def test_an_http_1_0_caller_is_refused_and_the_connection_closed(full):
    server, _ = full
    answer = raw(server.url, request(KEY, version="1.0"))  # recv returns b"" when closed
    assert answer.startswith(b"HTTP/1.1 429") and b"connection: close" in answer


def test_a_caller_without_the_key_gets_401_not_429_while_full(full):
    server, _ = full
    assert server.client.post("/v1/embeddings", json={"input": "x"}).status_code == 401
    wrong = server.client.post("/v1/embeddings", json={"input": "x"},
                               headers={"authorization": "Bearer wrong-key-0"})
    assert wrong.status_code == 401
    assert b"HTTP/1.1 401" in raw(server.url, request(None, version="1.0"))


def test_a_refused_connection_closed_by_its_client_is_cleaned_up(full):
    server, _ = full
    for _ in range(3):
        assert raw(server.url, request(KEY)).startswith(b"HTTP/1.1 429")  # then closed
    assert server.client.get("/health").status_code == 200


def test_refusals_are_counted_in_metrics(full):
    server, auth = full
    for _ in range(5):
        server.client.post("/v1/embeddings", json={"input": "x"}, headers=auth)
    metrics = server.client.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith(
        'vllm_srun_requests_total{endpoint="embeddings",outcome="overloaded"}'))
    assert float(line.split()[-1]) >= 5
