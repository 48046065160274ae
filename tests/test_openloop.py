"""The open-loop load generator (bench/openloop.c, SPEC R8.2): latency counts from each
request's scheduled send time, so a server slower than the arrival rate shows its queue
(no coordinated omission), and one seed gives one schedule.

The server here is a tiny real HTTP/1.1 server (keep-alive, Content-Length) that takes a fixed
delay per request with at most ``SLOTS`` requests at a time: its capacity is SLOTS / DELAY_S.
"""

from __future__ import annotations

import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import openloop

pytestmark = pytest.mark.required_in_ci

DELAY_S = 0.02
SLOTS = 2  # capacity: 100 req/s


@pytest.fixture(scope="module")
def built():
    if openloop.compiler() is None:
        pytest.skip("no C compiler (cc) to build bench/openloop.c")
    return openloop.build()


@pytest.fixture(scope="module")
def server():
    slots = threading.Semaphore(SLOTS)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else its head and body wait on a delayed ACK (40 ms)

        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            with slots:
                time.sleep(DELAY_S)
            body = b'{"ok": true}'
            if self.path == "/chunked":  # the same answer in two chunks, then a trailer
                self.send_response(201)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"5\r\n" + body[:5] + b"\r\n" + f"{len(body) - 5:x}".encode()
                                 + b"\r\n" + body[5:] + b"\r\n0\r\nX-End: 1\r\n\r\n")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture()
def bodies(tmp_path):
    path = tmp_path / "bodies.jsonl"
    path.write_text("".join(f'{{"input": "request {i}"}}\n' for i in range(2000)))
    return path


def test_same_seed_same_schedule_at_the_rate(built):
    a = openloop.schedule(50, 20, seed=7)
    assert a == openloop.schedule(50, 20, seed=7)
    assert a != openloop.schedule(50, 20, seed=8)
    assert a == sorted(a) and a[0] >= 0 and a[-1] < 20
    assert 900 <= len(a) <= 1100  # 1000 expected; Poisson's sd is ~32
    gaps = [b - x for x, b in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.15)  # exponential: sd=mean


def test_below_capacity_latency_is_the_service_time(built, server, bodies, tmp_path):
    lat = tmp_path / "lat.txt"
    r = openloop.run(server, bodies, rate_rps=20, duration_s=2, seed=1, connections=8,
                     latencies=lat)
    assert r["status"]["2xx"] == r["completed"] == r["scheduled"] > 20
    assert r["status"]["error"] == 0
    assert DELAY_S * 1e3 <= r["p50_ms"] < DELAY_S * 1e3 + 40  # the delay, plus a loaded host
    rows = openloop.read_latencies(lat)
    assert [x["scheduled_s"] for x in rows] == openloop.schedule(20, 2, seed=1)
    assert all(x["sent_s"] >= x["scheduled_s"] for x in rows)


def test_above_capacity_the_queue_shows_in_latency_from_schedule(built, server, bodies,
                                                                 tmp_path):
    """Twice the capacity over 2 connections (no more than the server's slots): each request,
    once sent, takes about the delay, yet its latency from schedule grows over the run, as
    the requests queued behind the busy connections wait in the generator."""
    lat = tmp_path / "lat.txt"
    r = openloop.run(server, bodies, rate_rps=2 * SLOTS / DELAY_S, duration_s=1.5, seed=2,
                     connections=SLOTS, latencies=lat)
    rows = openloop.read_latencies(lat)
    assert r["completed"] == len(rows) == r["scheduled"]
    from_schedule = openloop.latencies_ms(rows)
    fifth = len(from_schedule) // 5
    first, last = statistics.median(from_schedule[:fifth]), statistics.median(
        from_schedule[-fifth:])
    assert last > 5 * first and last > 400  # about 1.2 s behind by the end of 1.5 s
    from_send = [(x["done_s"] - x["sent_s"]) * 1e3 for x in rows]
    assert statistics.median(from_send) < DELAY_S * 1e3 + 40  # what a closed loop would see
    assert r["p99_ms"] > 10 * statistics.median(from_send)
    assert r["achieved_rps"] < 0.8 * r["offered_rps"]


def test_chunked_answers_are_read_to_their_end(built, server, bodies):
    r = openloop.run(server, bodies, rate_rps=40, duration_s=1, seed=3, connections=2,
                     path="/chunked")
    assert r["status"]["2xx"] == r["completed"] == r["scheduled"] > 10
    assert r["p50_ms"] < DELAY_S * 1e3 + 40  # each answer ended at its last chunk


def test_bad_arguments_are_refused_naming_the_option(built, bodies):
    import subprocess

    for args, named in ((["--rate", "0"], "--rate"), (["--rate", "x1"], "--rate"),
                        (["--port", "0"], "--port")):
        base = ["--rate", "5", "--duration-s", "1", "--port", "9", "--bodies", str(bodies)]
        done = subprocess.run([str(built), *base, *args], capture_output=True, text=True)
        assert done.returncode == 2 and named in done.stderr, (args, done.stderr)
