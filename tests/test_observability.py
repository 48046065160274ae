"""R5.7, R4.10, STYLE habit 8: what an operator sees of a real server: ``/metrics`` after real
requests (request duration by route and status class, the engine's queue wait, prompt tokens,
the learning state per range, forward buckets up to 120 s), ``x-request-id`` and
``Server-Timing`` on every answer, and log lines as JSON with the request id."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import L3, words
from vllm_srun.server.worker.logs import fields, log_format
from vllm_srun.server.worker.trace import valid_request_id


class LoggedServer:
    """``vllm-srun serve`` whose stderr goes to a file (debug lines would fill a pipe)."""

    def __init__(self, tmp_path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp_path / "stderr.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_srun.server", "serve", L3, *args, "--port", "0"],
                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        assert "http://" in line, self.log.read_text()
        self.client = httpx.Client(base_url=line.strip().rsplit(" ", 1)[-1], timeout=60)
        end = time.monotonic() + 120
        while self.client.get("/health").status_code != 200:
            assert time.monotonic() < end and self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)

    def close(self) -> list[str]:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return self.log.read_text().splitlines()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a /metrics page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def timing(header: str) -> dict[str, float]:
    """``Server-Timing`` (W3C: ``name;dur=ms, ...``) as {name: ms}."""
    out = {}
    for part in header.split(","):
        m = re.fullmatch(r"\s*([a-z]+);dur=(\d+(?:\.\d+)?)\s*", part)
        assert m is not None, header
        out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_request_ids_and_json_logs_of_a_real_server(tmp_path):
    """The one-worker shorthand in mode 1: every answer (200, 400, 404) has a request id and
    Server-Timing; /metrics counts exactly the requests sent; the learning gauges agree with
    GET /v1/threads; log lines are JSON, the lifecycle ones with their fields."""
    server = LoggedServer(tmp_path, "--threads", "1", "--max-threads", "2", "--record",
                          str(tmp_path / "r.sqlite"), "--log-format", "json",
                          "--log-level", "debug", env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"})
    try:
        c = server.client
        ok = c.post("/v1/embeddings", json={"input": [words(5), words(40)]},
                    headers={"x-request-id": "trace-1"})
        again = c.post("/v1/embeddings", json={"input": words(9)},
                       headers={"x-request-id": "bad id " + "x" * 200})
        bad = c.post("/v1/embeddings", json={"input": ""})
        missing = c.get("/no/such/path")
        page = c.get("/metrics").text
        (rep,) = c.get("/v1/threads").json()["reports"]
    finally:
        lines = server.close()
    assert [r.status_code for r in (ok, again, bad, missing)] == [200, 200, 400, 404]
    assert ok.headers["x-request-id"] == "trace-1"
    for r in (again, bad, missing):  # invalid or absent: a new id, 32 hex digits
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
    assert len({r.headers["x-request-id"] for r in (again, bad, missing)}) == 3
    phases = timing(ok.headers["server-timing"])
    assert list(phases) == ["queue", "forward", "total"]
    assert phases["queue"] + phases["forward"] <= phases["total"] and phases["forward"] > 0
    assert list(timing(bad.headers["server-timing"])) == ["total"]

    m = samples(page)
    duration = "vllm_srun_request_duration_seconds_count"
    assert m[(duration, (("route", "/v1/embeddings"), ("status_class", "2xx")))] == 2
    assert m[(duration, (("route", "/v1/embeddings"), ("status_class", "4xx")))] == 1
    assert m[(duration, (("route", "other"), ("status_class", "4xx")))] == 1
    assert m[("vllm_srun_queue_wait_seconds_count", (("deployment", "primary"),))] == 2
    tokens = ok.json()["usage"]["prompt_tokens"] + again.json()["usage"]["prompt_tokens"]
    assert m[("vllm_srun_input_tokens_total", (("deployment", "primary"),))] == tokens == 60
    replica = (("replica", rep["replica"]),)
    assert {s: m[("vllm_srun_learning_state", (*replica, ("state", s)))]
            for s in ("locked", "learning", "serving", "retired")} == {
        "locked": 0, "learning": 1, "serving": 0, "retired": 0} and rep["state"] == "learning"
    assert m[("vllm_srun_learning_retired", replica)] == 0
    assert m[("vllm_srun_learning_voucher", replica)] == 0
    assert m[("vllm_srun_non_finite_answers", replica)] == 0  # every answer was finite
    for rng in rep["ranges"]:
        labels = (*replica, ("size_range", rng["size_range"]))
        assert m[("vllm_srun_range_served_threads", labels)] == rng["served_threads"] == 1
        assert m[("vllm_srun_range_learned_threads", labels)] == (rng["learned_threads"] or 0)
        assert m[("vllm_srun_range_state", (*replica, ("size_range", rng["size_range"]),
                                            ("state", rng["state"])))] == 1
    assert {r["size_range"] for r in rep["ranges"]} >= {"4-7", "32-63"}  # 7 and 42 tokens
    buckets = {dict(k[1])["le"] for k in m if k[0] == "vllm_srun_forward_seconds_bucket"}
    assert {"30.0", "60.0", "120.0"} <= buckets

    # our lines are JSON objects (a library's own process, such as multiprocessing's resource
    # tracker at exit, may still write text to the same stderr)
    docs = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(docs) >= len(lines) - 2, lines
    (access,) = [d for d in docs if d.get("event") == "request" and d.get("request_id")
                 == "trace-1"]
    assert (access["route"], access["status"], access["deployment"], access["tokens"]) == \
        ("/v1/embeddings", 200, "primary", 49)
    assert any(d["event"] == "request" and d["status"] == 404 and d["route"] == "other"
               for d in docs)
    (listening,) = [d for d in docs if d.get("event") == "server_listening"]
    assert (listening["deployment"], listening["replicas"], listening["adaptive_mode"]) == \
        ("primary", 1, 1)
    (ready,) = [d for d in docs if d.get("event") == "worker_ready"]
    assert (ready["model"], ready["num_threads"], ready["level"]) == (L3, 1, "info")


def test_request_timing_comes_back_from_worker_processes(tmp_path):
    """Two worker processes: the engine's queue and forward time cross the worker protocol
    into Server-Timing and the queue-wait histogram; text log lines keep key=value."""
    server = LoggedServer(tmp_path, "-dp", "2", "--threads", "1", "--log-format", "text",
                          "--log-level", "info")
    try:
        answers = [server.client.post("/v1/embeddings", json={"input": words(3 + i)},
                                      headers={"x-request-id": f"r{i}"}) for i in range(4)]
        page = server.client.get("/metrics").text
    finally:
        lines = server.close()
    assert [a.headers["x-request-id"] for a in answers] == ["r0", "r1", "r2", "r3"]
    assert all(list(timing(a.headers["server-timing"])) == ["queue", "forward", "total"]
               for a in answers)
    m = samples(page)
    assert m[("vllm_srun_queue_wait_seconds_count", (("deployment", "primary"),))] == 4
    ready = [line for line in lines if " worker_ready " in line]
    assert len(ready) == 2 and all(" INFO worker[" in line and f"model={L3}" in line
                                   for line in ready)


def test_bad_log_format_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vllm_srun.server", "serve", "--port", "0"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "VLLM_SRUN_LOG_FORMAT": "xml"})
    assert r.returncode == 2 and "VLLM_SRUN_LOG_FORMAT must be one of text, json, got 'xml'" \
        in r.stderr


@pytest.mark.parametrize(("line", "event", "parsed"), [
    ("worker_ready model=m revision=abc num_threads=2 warm_s=0.125", "worker_ready",
     {"model": "m", "revision": "abc", "num_threads": 2, "warm_s": 0.125}),
    ("request_failed endpoint=embeddings code=internal_error error=forward failed: boom",
     "request_failed", {"endpoint": "embeddings", "code": "internal_error",
                        "error": "forward failed: boom"}),
    ("limits_calibrated device=cpu max_num_batched_tokens=128 (set: seqs=None tokens=None)",
     "limits_calibrated", {"device": "cpu", "max_num_batched_tokens": 128, "seqs": "None",
                           "tokens": "None)"}),
    ("Started server process", None, {}),
    ("reconfigured {'added': []}", "reconfigured", {}),
])
def test_log_fields(line, event, parsed):
    assert fields(line) == (event, parsed)


def test_log_format_and_request_id_rules():
    assert (log_format(None, {}), log_format("json", {"VLLM_SRUN_LOG_FORMAT": "text"}),
            log_format(None, {"VLLM_SRUN_LOG_FORMAT": "json"})) == ("text", "json", "json")
    assert valid_request_id("a" * 128) and not valid_request_id("a" * 129)
    assert not any(valid_request_id(v) for v in ("", "a b", "tab\there", "é", None))
