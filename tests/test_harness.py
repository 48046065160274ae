"""The suite's server harness (tests/conftest.py): a request to a server that died under it
fails naming the exit status and what the server wrote last, not a bare transport error."""

from __future__ import annotations

import pytest

from tests.conftest import L3, Server, ServerExited


def test_a_request_to_a_server_that_died_names_its_exit_and_stderr():
    server = Server(L3, "--threads", "1")
    try:
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(ServerExited, match=r"GET /health: .*exited with -9"):
            server.client.get("/health")
    finally:
        server.close()
