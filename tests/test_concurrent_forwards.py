"""Several forwards at once in one worker (``EngineArgs.concurrent_forwards``): a short
request is answered while a long forward is still running, with the answers one forward at a
time gives, each forward at its count; where it cannot apply the server refuses it at start,
naming the key and why."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import L6, Server, row, run_cli
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.engine import Engine
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.pool.config import EngineConfig, ReplicaConfig, validate
from vllm_srun.server.pool.flags import single
from vllm_srun.server.pool.replica_factory import PoolOptions, check_concurrent_forwards
from vllm_srun.tuner.modes import ADAPTIVE_ENV

LONG = row(256)


class Held:
    """The real backend, with a forward of at least ``rows`` rows held from its start until
    ``release`` is set (a forward that takes as long as the test needs)."""

    def __init__(self, backend, rows: int) -> None:
        self.inner, self.rows = backend, rows
        self.started, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, num_threads):
        if batch.rows >= self.rows:
            self.started.set()
            assert self.release.wait(60)
        return self.inner.forward(batch, num_threads)


@pytest.mark.parametrize(("backend_name", "at_once"),
                         [("onnxruntime", 1), ("onnxruntime", 2), ("torch", 2)])
def test_a_short_request_is_answered_beside_a_long_forward(backend_name, at_once):
    """With two forwards at once, short requests are answered while a 16-row forward holds
    the other: as one forward at a time would answer them (within 1e-5), each forward at its
    count as observed inside it (R2.2). With one at a time they wait for it."""
    records = []
    held = Held(load_backend(resolve(L6), backend_name), rows=16)
    runner = Runner(resolve(L6), held, EngineArgs(num_threads=1, concurrent_forwards=at_once),
                    on_forward=records.append)
    runner.start()
    engine = runner.engine
    try:
        long = engine.submit([LONG] * 16)
        assert held.started.wait(30)
        short = [engine.submit([row(8 + i, salt=i)]) for i in range(6)]
        if at_once == 1:
            with pytest.raises(TimeoutError):
                short[0].result(timeout=2)
            held.release.set()
        else:
            got = [f.result(timeout=30) for f in short]
            assert not long.done()
            held.release.set()
            for i, out in enumerate(got):
                alone = engine.forward([row(8 + i, salt=i)], 1).outputs[0]
                assert np.abs(out[0] - alone).max() < 1e-5
        assert long.result(timeout=60).shape == (16, 384)
        assert all(f.result(timeout=30).shape == (1, 384) for f in short)
        assert records and all(r.observed_threads == r.num_threads == 1 for r in records)
    finally:
        held.release.set()
        runner.stop()


def test_an_engine_with_a_learning_policy_runs_one_forward_at_a_time():
    class Learning:  # any policy other than fixed counts hears one forward at a time
        def served_threads(self, batch):
            return 1

        def observe(self, batch, result):
            return None

        def close(self):
            return None

    backend = load_backend(resolve(L6), "onnxruntime")
    with pytest.raises(ValueError, match="fixed thread counts"):
        Engine(backend, EngineArgs(num_threads=1, concurrent_forwards=2), threads=Learning())


def _refusal(options: PoolOptions, **deployment) -> str:
    config = single(L6, engine=EngineConfig(concurrent_forwards=2,
                                            num_threads=deployment.pop("threads", 1)),
                    **deployment)
    with pytest.raises(ConfigError) as caught:
        check_concurrent_forwards(options, config)
    message = str(caught.value)
    assert "engine.concurrent_forwards (--concurrent-forwards) 2" in message
    return message


def test_where_several_forwards_cannot_run_the_deployment_is_refused_naming_why():
    options = PoolOptions(budget=2)
    check_concurrent_forwards(options, single(L6, engine=EngineConfig(concurrent_forwards=2)))
    assert "more than the CPU budget of 2" in _refusal(options, threads=2)
    assert "adaptive threads off" in _refusal(PoolOptions(budget=2, mode=1))
    assert "one-worker deployment" in _refusal(
        options, replicas=[ReplicaConfig(device="cpu"), ReplicaConfig(device="cpu")])
    on_gpu = validate({"global": {"router": {"enabled": False}, "model_catalog": {
        "deployments": {"primary": {"artifact": L6, "device": "cuda:0", "engine": {
            "concurrent_forwards": 2}}}}}})
    with pytest.raises(ConfigError, match="CPU workers only"):
        check_concurrent_forwards(options, on_gpu)
    with pytest.raises(ValueError, match="concurrent_forwards"):
        EngineConfig(concurrent_forwards=0)
    with pytest.raises(ValueError, match="concurrent_forwards"):
        EngineConfig(concurrent_forwards=17)


def test_serve_refuses_several_forwards_with_adaptive_threads_before_loading():
    run = run_cli("serve", L6, "--concurrent-forwards", "2", "--threads", "1",
                  env={ADAPTIVE_ENV: "2"})
    assert run.returncode != 0
    assert "several forwards at once run with adaptive threads off" in run.stderr
    run = run_cli("serve", L6, "--concurrent-forwards", "0")
    assert run.returncode != 0 and "--concurrent-forwards must be a positive integer" in run.stderr


def test_a_server_with_two_forwards_at_once_answers_over_http(l6_server):
    """Answers as a server running one forward at a time gives them (within 1e-5)."""
    if cpu_budget() < 2:
        pytest.skip("a CPU budget of 1 refuses two 1-thread forwards at once (by design)")
    server = Server(L6, "--threads", "1", "--concurrent-forwards", "2").wait_ready()
    try:
        (entry,) = server.client.get("/v1/models").json()["data"]
        assert (entry["num_threads"], entry["concurrent_forwards"]) == (1, 2)
        texts = [f"query number {i} about forwards at once" for i in range(24)]

        def embed(client, text):
            answer = client.post("/v1/embeddings", json={"model": L6, "input": text})
            assert answer.status_code == 200, answer.text
            return np.array(answer.json()["data"][0]["embedding"])

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda t: embed(server.client, t), texts))
        for text, vector in zip(texts, got, strict=True):
            assert np.abs(vector - embed(l6_server.client, text)).max() < 1e-5
    finally:
        server.close()
