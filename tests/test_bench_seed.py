"""bench.adaptive_wrk's common random numbers: wrk runs given one seed send the same requests
(bodies, lengths, think times), so bench.adaptive_load's servers of a round see the same
traffic and a paired ratio compares the servers. Real wrk against a real HTTP server on
loopback that records the bodies; skipped, saying so, where wrk is not installed (CI installs
it, and there a skip fails the run: required_in_ci)."""

from __future__ import annotations

import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.adaptive_wrk import lua, wrk

pytestmark = [pytest.mark.required_in_ci,  # .ci/run installs wrk
              pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")]


def bodies(script: str, seed: int | None, n: int = 30) -> list[bytes]:
    """The first ``n`` bodies one wrk connection sends with ``seed``."""
    got: list[bytes] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wrk(f"http://127.0.0.1:{server.server_address[1]}", script, 1, 1, seed)
    finally:
        server.shutdown()
        server.server_close()
    assert len(got) >= n, len(got)
    return got[:n]


def test_one_seed_sends_the_same_requests_and_another_seed_others(tmp_path):
    script = tmp_path / "mixed.lua"
    script.write_text(lua("m", think_ms=1.0))  # Poisson pacing: think times drawn too
    first, again = bodies(str(script), 7), bodies(str(script), 7)
    assert first == again
    other = bodies(str(script), 8)
    assert not set(first) & set(other)  # unique bodies: no result cache answers a repeat
    assert len({len(b) for b in first}) > 1  # the mix's lengths, drawn from the seed
