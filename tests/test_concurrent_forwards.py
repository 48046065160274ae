"""Several forwards at once in one worker (``EngineArgs.concurrent_forwards``): a short
request is answered while a long forward is still running, with the answers one forward at a
time gives, each forward at its count; where it cannot apply the server refuses it at start,
naming the key and why."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import L6, Server, SlowerAt, poll, row, run_cli, serve_paced, start
from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.engine import Engine, pad
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.pool.config import EngineConfig, ReplicaConfig, validate
from vllm_srun.server.pool.flags import single
from vllm_srun.server.pool.replica_factory import PoolOptions, check_concurrent_forwards
from vllm_srun.tuner.adaptive import output_bits
from vllm_srun.tuner.inflight import InFlight, Timed
from vllm_srun.tuner.modes import ADAPTIVE_ENV, AdaptiveMode
from vllm_srun.tuner.report import build, from_tuner
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep

LONG = row(256)


class Held:
    """The real backend, with the forwards ``when`` picks held from their start until
    ``release`` is set (a forward that takes as long as the test needs; shadows run on its
    twin, never held)."""

    def __init__(self, backend, when) -> None:
        self.inner, self.when = backend, when
        self.started, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, num_threads):
        if self.when(batch):
            self.started.set()
            assert self.release.wait(60)
        return self.inner.forward(batch, num_threads)


def one_row_of(length: int):
    return lambda batch: batch.input_ids.shape == (1, length)


@pytest.mark.parametrize(("backend_name", "at_once"),
                         [("onnxruntime", 1), ("onnxruntime", 2), ("torch", 2)])
def test_a_short_request_is_answered_beside_a_long_forward(backend_name, at_once):
    """With two forwards at once, short requests are answered while a 16-row forward holds
    the other: as one forward at a time would answer them (within 1e-5), each forward at its
    count as observed inside it (R2.2). With one at a time they wait for it."""
    records = []
    held = Held(load_backend(resolve(L6), backend_name), lambda b: b.rows >= 16)
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


class AtCount:
    """Every forward at ``count`` threads; ``several_at_once``: whether it says it hears
    forwards from several threads at once."""

    def __init__(self, count: int, several_at_once: bool) -> None:
        self.count, self.several_at_once = count, several_at_once

    def served_threads(self, batch):
        return self.count

    def observe(self, batch, result):
        return None

    def close(self):
        return None


def test_an_engine_runs_several_forwards_at_once_only_with_a_policy_that_hears_them():
    backend = load_backend(resolve(L6), "onnxruntime")
    one_at_a_time = AtCount(1, several_at_once=False)
    with pytest.raises(ValueError, match="AtCount hears one served forward at a time"):
        Engine(backend, EngineArgs(num_threads=1, concurrent_forwards=2), threads=one_at_a_time)
    engine = Engine(backend, EngineArgs(num_threads=1, concurrent_forwards=2))
    engine.threads = one_at_a_time  # set after construction, as a worker sets its tuner
    with pytest.raises(ValueError, match="hears one served forward at a time"):
        engine.start()


def test_two_torch_forwards_at_one_count_above_the_configured_run_at_once():
    """torch's count lives on the OS thread, so a forward runs on a lane of its count: each
    engine thread has lanes of its own, and a second forward at 2 threads (configured 1)
    runs while the first is held, with the answer one forward alone gives."""
    held = Held(load_backend(resolve(L6), "torch"), one_row_of(117))
    engine = Engine(held, EngineArgs(num_threads=1, concurrent_forwards=2),
                    threads=AtCount(2, several_at_once=True))
    engine.start()
    try:
        first = engine.submit([row(117)])
        assert held.started.wait(30)
        second = engine.submit([row(40)]).result(timeout=30)
        assert not first.done()
        held.release.set()
        assert first.result(timeout=60).shape == (1, 384)
        alone = engine.forward([row(40)], 2).outputs[0]
        assert np.array_equal(second[0], alone)
    finally:
        held.release.set()
        engine.stop()


def test_in_flight_room_and_solo_follow_the_forwards_running():
    """``InFlight``: the room is the budget less the counts of the forwards running; a
    forward is solo only if none ran at its start and none started or ended during it."""
    flight = InFlight(cores=4)

    def begin(batch, count):
        flight.served_started()
        flight.timed[id(batch)] = Timed(False, True, 0, None, True, count, flight.busy,
                                        flight.epoch)

    a, b, c = object(), object(), object()
    begin(a, 2)
    assert flight.room() == 2
    begin(b, 1)  # b starts while a runs: neither is solo
    assert flight.room() == 1
    assert not flight.solo(flight.served_ended(b)) and not flight.solo(flight.served_ended(a))
    begin(c, 4)  # alone from start to end
    assert flight.room() == 0 and flight.solo(flight.served_ended(c)) and flight.room() == 4


def test_mode2_serves_a_forward_alone_its_learned_count_and_one_beside_another_its_share(
        tmp_path):
    """Adaptive threads with two forwards at once on a budget of 2 (R4.8, R4.12 inside one
    worker): a forward alone takes its range's learned count (2); one that starts while a
    2-thread forward runs takes the configured count, the share the budget leaves, and is
    no refusal; a forward another ran beside is no sample. Every answer is bit for bit the
    configured count's. Count 1 is made 5x slower in reported time, so 2 is learned."""
    backend = load_backend(resolve(L6), "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    scope = Scope("test-host", resolve(L6).revision, "onnxruntime")
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=128, max_padded=128))
    res = sweep(lambda b, n: backend.forward(b, n), 1, (1, 2), plan.shapes)
    assert res.mismatches == 0
    record.add_voucher(scope, "verify", res.comparisons, res.mismatches, plan.coverage((1, 2)))
    context = ThreadContext()
    rows = {"held": row(117), "beside": row(100, 999), "fresh": row(10), "alone": row(10, 1)}
    reference = {k: context.run(1, lambda r=r: backend.forward(pad([r]), 1)).outputs
                 for k, r in rows.items()}
    context.shutdown()
    held = Held(SlowerAt(backend, 1, 5.0), one_row_of(117))
    runner, tuner = start(held, record, AdaptiveMode.SERVE, 1, (1, 2), at_once=2)
    try:
        for i in range(60):  # one client: every forward alone
            serve_paced(runner, tuner, row(100, i))
            if runner.served[-1].num_threads == 2 and i > 20:
                break
        assert runner.served[-1].num_threads == 2, "range 64-127 never served its learned 2"
        timed_before = tuner.tally.served_samples
        first = runner.engine.submit([rows["held"]])
        assert held.started.wait(30)
        got = {k: runner.engine.submit([rows[k]]).result(timeout=60) for k in ("beside",
                                                                                "fresh")}
        assert not first.done()
        held.release.set()
        got["held"] = first.result(timeout=60)
        poll(lambda: tuner.flight.busy == 0, 10)
        assert tuner.tally.served_samples == timed_before  # beside another: no sample
        got["alone"] = serve_paced(runner, tuner, rows["alone"])
        report = build(from_tuner(tuner))
    finally:
        held.release.set()
        runner.stop()
    by_shape = {(r.rows, r.padded_tokens): r.num_threads for r in runner.served[-4:]}
    assert by_shape[(1, 117)] == 2  # alone at its start: the learned count
    assert by_shape[(1, 100)] == 1  # beside a 2-thread forward on 2 cores: the configured
    assert tuner.tally.beside >= 1 and tuner.tally.not_solo >= 3
    assert not tuner.learner.ranges[64].refused  # the worker's own forwards refuse nothing
    assert tuner.tally.served_samples == timed_before + 1  # the fresh range's forward alone
    for k, out in got.items():
        assert np.array_equal(output_bits(out), output_bits(reference[k])), k
    learning = report["learning"]
    assert learning["forwards_served_lower_beside_other_forwards"] == tuner.tally.beside
    assert learning["served_forwards_not_timed_beside_another"] == tuner.tally.not_solo


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
    check_concurrent_forwards(PoolOptions(budget=2, mode=2),  # adaptive threads: allowed
                              single(L6, engine=EngineConfig(concurrent_forwards=2)))
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


def test_serve_refuses_bad_several_forwards_before_loading():
    """With adaptive threads too (they run with several forwards at once): N forwards at the
    configured count past the budget are refused, naming the key."""
    run = run_cli("serve", L6, "--concurrent-forwards", "16", "--threads", "16",
                  env={ADAPTIVE_ENV: "2"})
    assert run.returncode != 0
    assert "engine.concurrent_forwards (--concurrent-forwards) 16" in run.stderr
    assert "more than the CPU budget" in run.stderr
    run = run_cli("serve", L6, "--concurrent-forwards", "0")
    assert run.returncode != 0 and "--concurrent-forwards must be a positive integer" in run.stderr


@pytest.mark.parametrize("mode", ["0", "1", "2"])
def test_a_server_with_two_forwards_at_once_answers_over_http(l6_server, mode, tmp_path):
    """Answers as a server running one forward at a time gives them (within 1e-5), with
    adaptive threads off and in modes 1 and 2 (whose reports count the forwards served
    beside another)."""
    if cpu_budget() < 2:
        pytest.skip("a CPU budget of 1 refuses two 1-thread forwards at once (by design)")
    server = Server(L6, "--threads", "1", "--concurrent-forwards", "2", "--record",
                    str(tmp_path / "r.sqlite"), env={ADAPTIVE_ENV: mode}).wait_ready()
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
        if mode != "0":
            (report,) = server.client.get("/v1/threads").json()["reports"]
            learning = report["learning"]
            # eight clients on two forwards at once: some forward ran beside another
            assert learning["served_forwards_not_timed_beside_another"] >= 1, learning
            assert "forwards_served_lower_beside_other_forwards" in learning
    finally:
        server.close()
