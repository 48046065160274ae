"""The replica pool with real worker processes and real faults (R5.1-R5.10, R6.1, R7.3).

Faults are injected into real workers through the test-only launcher ``tests/faults.py`` (a
folder: the file named after a replica makes its forward ``hang`` or ``slow MS``) or by
signalling the worker process. Nothing of the pool is mocked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.conftest import L6, Server, cpu_deployment, poll, write_config
from vllm_srun.records.host_record import default_record_path
from vllm_srun.runtime.paths import data_dir
from vllm_srun.runtime.types import Task
from vllm_srun.server.pool import deployment_pool
from vllm_srun.server.pool.config import DeploymentConfig, EngineConfig
from vllm_srun.server.pool.deployment_pool import DeploymentPool, ModelInfo
from vllm_srun.server.pool.errors import ExchangeError
from vllm_srun.server.pool.outlier import Outcome, OutlierPolicy, OutlierSettings
from vllm_srun.server.pool.replicas import AttachedReplica, LoadAccount
from vllm_srun.server.pool.states import ReplicaState
from vllm_srun.tuner.cores import CoreShare, cores_path

ALL_OK_FRACTION = 0.99


class PoolServer(Server):
    def __init__(self, tmp_path: Path, deployments: dict, bound: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.faults = tmp_path / "faults"
        self.faults.mkdir(exist_ok=True)
        self.config_path = write_config(tmp_path / "config.yaml", deployments, bound)
        super().__init__("--config", str(self.config_path), env=env, faults=self.faults)

    def fault(self, replica: str, what: str | None) -> None:
        path = self.faults / replica
        if what is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(what)

    def inventory(self) -> dict:
        return self.client.get("/v1/inventory").json()

    def replicas(self, deployment: str = "primary") -> dict[str, dict]:
        dep = next(d for d in self.inventory()["deployments"] if d["name"] == deployment)
        return {r["id"]: r for r in dep["replicas"]}

    def events(self, kind: str, replica: str | None = None) -> list[dict]:
        return [e for e in self.inventory()["events"]
                if e["event"] == kind and (replica is None or e["replica"] == replica)]

    def wait_for(self, predicate, timeout_s: float = 60, what: str = "condition"):
        if value := poll(predicate, timeout_s, 0.1):
            return value
        raise TimeoutError(f"{what} did not happen; inventory: {self.inventory()}")

    def wait_all_ready(self, deployment: str = "primary", n: int | None = None) -> None:
        def done():
            reps = self.replicas(deployment)
            return (n is None or len(reps) == n) and all(
                r["state"] == "ready" for r in reps.values())
        self.wait_for(done, 120, f"{deployment} all ready")

    def reload(self, deployments: dict, bound: str | None = None) -> None:
        write_config(self.config_path, deployments, bound)
        self.proc.send_signal(signal.SIGHUP)


def fire(url: str, texts: list[str], concurrency: int, timeout_ms: int | None = None,
         model: str | None = None, during=None) -> list[tuple[int, float, dict]]:
    """Send one request per text with ``concurrency`` in flight; (status, seconds, body)."""
    async def main():
        sem = asyncio.Semaphore(concurrency)
        headers = {"x-request-timeout-ms": str(timeout_ms)} if timeout_ms else {}
        limits = httpx.Limits(max_connections=concurrency + 8)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            async def one(text):
                async with sem:
                    start = time.monotonic()
                    body = {"input": text, **({"model": model} if model else {})}
                    r = await client.post("/v1/embeddings", json=body, headers=headers)
                    return r.status_code, time.monotonic() - start, r.json() | {
                        "_headers": dict(r.headers)}
            tasks = [asyncio.create_task(one(t)) for t in texts]
            if during is not None:
                await asyncio.sleep(0.3)
                await asyncio.to_thread(during)
            return await asyncio.gather(*tasks)
    return asyncio.run(main())


def texts(n: int, tag: str) -> list[str]:
    """Distinct short texts (distinct so that worker caches do not answer them)."""
    return [f"{tag} request number {i} about replicas" for i in range(n)]


def ok_fraction(results) -> float:
    return sum(1 for s, _, _ in results if s == 200) / len(results)


@pytest.fixture
def three(tmp_path):
    server = PoolServer(tmp_path, {"primary": cpu_deployment(3, timeout_ms=800,
                                                             base_ejection_ms=3000)})
    server.wait_ready()
    server.wait_all_ready(n=3)
    yield server
    server.close()


def test_hung_forward_with_health_ok_is_ejected_and_traffic_survives(tmp_path):
    """A worker whose forward hangs while /health answers (the Ray Serve failure): timeouts
    eject it, >= 99% of requests are answered, and it returns after the cool-down. (The
    cool-down outlasts the flood: a readmission mid-flood would rightly cost the replica's
    next timeouts too, R5.6.)"""
    three = PoolServer(tmp_path, {"primary": cpu_deployment(3, timeout_ms=800,
                                                            base_ejection_ms=COOL_DOWN_MS)})
    try:
        three.wait_ready()
        three.wait_all_ready(n=3)
        hung_replica_survives(three)
    finally:
        three.close()


COOL_DOWN_MS = 8000


def hung_replica_survives(three) -> None:
    three.fault("primary-1", "hang")
    results = fire(three.url, texts(400, "hang"), concurrency=6)
    assert ok_fraction(results) >= ALL_OK_FRACTION, [r[:2] for r in results if r[0] != 200]
    assert {s for s, _, _ in results} <= {200, 504}
    assert three.replicas()["primary-1"]["state"] == "ejected"
    (ejected,) = three.events("replica_ejected", "primary-1")
    assert ejected["ejection_ms"] == COOL_DOWN_MS and "consecutive timeouts" in ejected["reason"]
    assert any(e["reason"] == "health ok" for e in three.events("replica_probed", "primary-1"))
    metrics = three.client.get("/metrics").text
    assert 'vllm_srun_replica_ejections_total{deployment="primary",replica="primary-1"} 1.0' \
        in metrics
    assert 'vllm_srun_replica_state{deployment="primary",replica="primary-1",state="ejected"}' \
        in metrics
    assert all(r["state"] == "ready" for k, r in three.replicas().items() if k != "primary-1")

    three.fault("primary-1", None)
    three.wait_for(lambda: three.events("replica_readmitted", "primary-1"), 15,
                   "readmission after the cool-down")
    assert three.events("replica_readmitted", "primary-1")[0]["reason"] == "cool-down ended"
    results = fire(three.url, texts(60, "after"), concurrency=6)
    assert ok_fraction(results) == 1.0
    assert 'vllm_srun_replica_readmissions_total{deployment="primary",replica="primary-1"}' \
        in three.client.get("/metrics").text


def test_a_flood_of_tiny_caller_deadlines_causes_no_backoff(three):
    """R5.5 (amended): exchanges past a caller's own shorter deadline count toward
    consecutive_timeouts but put no replica into backoff; requests whose deadline passed before
    they reached a replica are no exchange. Normal traffic flowing meanwhile is unharmed, and
    the seed's guards (at most max_ejection_percent out) decide any ejection."""
    flood: list = []
    flooder = threading.Thread(target=lambda: flood.extend(
        fire(three.url, texts(150, "tiny"), concurrency=6, timeout_ms=1)))
    flooder.start()
    normal = fire(three.url, texts(150, "normal"), concurrency=3)
    flooder.join()
    assert ok_fraction(normal) == 1.0, [r[:2] for r in normal if r[0] != 200]
    assert {s for s, _, _ in flood} <= {200, 504}
    assert three.events("replica_backoff") == []
    metrics = three.client.get("/metrics").text
    counted = [line for line in metrics.splitlines()
               if line.startswith("vllm_srun_replica_exchanges_total")
               and 'outcome="deadline"' in line]
    assert counted, "no exchange ran past a caller's deadline: the test exercised nothing"
    assert 'outcome="timeout"' not in metrics
    out: set[str] = set()
    for e in three.inventory()["events"]:  # at most 50% of 3 (one) ejected at any moment
        if e["event"] == "replica_ejected":
            out.add(e["replica"])
            assert len(out) <= 1, e
        elif e["event"] == "replica_readmitted":
            out.discard(e["replica"])


# -- how one deployment classifies a deadline, over a real exchange (R5.5, R5.6) -------------

class Silent:
    """A loopback HTTP endpoint that accepts and reads but never answers (a hung replica);
    ``connections`` counts the exchanges that reached it."""

    async def __aenter__(self) -> Silent:
        self.connections, self.writers = 0, []
        self.server = await asyncio.start_server(self._hold, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        await reader.read()  # until the pool gives up on the exchange (or the test ends)

    async def __aexit__(self, *_exc) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0)  # the handlers see their connections closed


class OneReplica:
    """A deployment of one attached replica (real httpx transport) on ``url``, with the
    outcomes it counted and the policy's events."""

    def __init__(self, url: str, timeout_ms: int) -> None:
        self.outcomes: list[str] = []
        self.events: list = []
        replica = AttachedReplica("r0", url, LoadAccount(url), {}, lambda *_a: None,
                                  endpoint=url, model="m")
        replica.state = ReplicaState.READY
        policy = OutlierPolicy(OutlierSettings(), time.monotonic, self.events.append)
        policy.add("r0")
        config = DeploymentConfig(artifact="m", endpoint=url, model="m",
                                  engine=EngineConfig(timeout_ms=timeout_ms))
        self.replica = replica
        info = ModelInfo("m", "m", Task.EMBED, None, (), None, None)
        self.pool = DeploymentPool("d", config, info, [replica], policy, lambda: 0,
                                   lambda _d, _r, outcome: self.outcomes.append(outcome))

    async def infer(self, caller_deadline_s: float | None):
        """One request with the caller's deadline ``caller_deadline_s`` from now; the
        ExchangeError it ends with."""
        deadline = None if caller_deadline_s is None else time.monotonic() + caller_deadline_s
        with pytest.raises(ExchangeError) as exc:
            await self.pool.infer(["x"], True, deadline)
        return exc.value

    def inventory(self) -> dict:
        (replica,) = self.pool.inventory(bound=True)["replicas"]
        return replica

    def backoffs(self) -> list[str]:
        return [e.reason for e in self.events if e.kind == "replica_backoff"]


def test_a_caller_deadline_shorter_than_timeout_ms_counts_but_backs_off_nothing():
    """R5.5: past the caller's own shorter deadline the exchange is a ``deadline``: it counts
    toward consecutive_timeouts, the replica stays in dispatch."""
    async def main():
        async with Silent() as endpoint:
            dep = OneReplica(endpoint.url, timeout_ms=10_000)
            err = await dep.infer(0.3)
            assert (err.code, endpoint.connections) == ("deadline_exceeded", 1)
            assert dep.outcomes == ["deadline"] and dep.backoffs() == []
            assert dep.inventory()["consecutive_timeouts"] == 1
            assert dep.inventory()["state"] == "ready" and dep.inventory()["in_flight"] == 0
            await dep.replica.stop()
    asyncio.run(main())


def test_past_timeout_ms_before_a_longer_caller_deadline_is_a_timeout_with_backoff():
    """R5.5: the deployment's timeout_ms ends the exchange first (the caller would wait 30 s):
    a ``timeout``, which counts and takes the replica out of dispatch for a backoff."""
    async def main():
        async with Silent() as endpoint:
            dep = OneReplica(endpoint.url, timeout_ms=300)
            for caller in (30.0, None):  # a longer caller deadline, and none at all
                err = await dep.infer(caller)
                assert err.code == "deadline_exceeded"
            assert dep.outcomes == ["timeout", "timeout"] and endpoint.connections == 2
            assert [r.split(":")[0] for r in dep.backoffs()] == ["timeout", "timeout"]
            assert dep.inventory()["consecutive_timeouts"] == 2
            assert dep.inventory()["state"] == "backoff"
            await dep.replica.stop()
    asyncio.run(main())


def test_a_request_whose_deadline_passed_before_dispatch_is_no_exchange(monkeypatch):
    """R5.5, R5.6: a request whose deadline passed before it reached the replica neither
    counts nor resets consecutive_timeouts, and nothing is sent. Twice: passed before the
    pool dispatches, and passed between the pool's dispatch and the send (the pool's clock
    held 1 s behind the transport's, the one thing faked)."""
    async def main():
        async with Silent() as endpoint:
            dep = OneReplica(endpoint.url, timeout_ms=10_000)
            await dep.infer(0.3)  # one exchange past the caller's deadline: the count is 1
            assert dep.inventory()["consecutive_timeouts"] == 1 and dep.outcomes == ["deadline"]

            err = await dep.infer(-0.001)
            assert err.outcome is Outcome.NOT_SENT and err.code == "deadline_exceeded"
            assert dep.outcomes == ["deadline"]  # no exchange: not even counted as one
            assert endpoint.connections == 1 and dep.backoffs() == []
            assert dep.inventory()["consecutive_timeouts"] == 1  # neither counted nor reset
            assert dep.inventory()["in_flight"] == 0

            behind = time.monotonic
            monkeypatch.setattr(deployment_pool, "time", types.SimpleNamespace(
                monotonic=lambda: behind() - 1.0))
            err = await dep.infer(-0.001)  # the pool dispatches; the transport sends nothing
            assert err.outcome is Outcome.NOT_SENT and err.replica_id == "r0"
            assert endpoint.connections == 1 and dep.backoffs() == []
            assert dep.inventory()["consecutive_timeouts"] == 1
            assert dep.inventory()["in_flight"] == 0 and dep.inventory()["state"] == "ready"
            await dep.replica.stop()
    asyncio.run(main())


def test_sigkill_mid_request_fails_promptly_and_the_worker_restarts(three):
    three.fault("primary-0", "slow 3000")
    victim = three.replicas()["primary-0"]["pid"]
    killed_at: list[float] = []

    def kill():
        # at once, with a request in flight there: the deployment's timeout is 800 ms, and a
        # kill after a fixed sleep landed past it under load (a 504, not the crash's 503)
        three.wait_for(lambda: three.replicas()["primary-0"]["in_flight"] >= 1, 5,
                       "a request in flight at primary-0")
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    start = time.monotonic()
    results = fire(three.url, texts(300, "kill"), concurrency=6, during=kill)
    failed = [r for r in results if r[0] != 200]
    assert ok_fraction(results) >= ALL_OK_FRACTION, [r[:2] for r in failed]
    for status, elapsed, body in failed:  # answered at once with a clear error, never hung
        assert status == 503 and body["error"]["code"] == "replica_failed"
        assert "primary-0" in body["error"]["message"]
        # well before the injected 3 s forward would have answered: the crash, not a timeout
        assert start + elapsed - killed_at[0] < 2.0
    three.fault("primary-0", None)
    three.wait_for(lambda: three.replicas()["primary-0"]["restarts"] == 1
                   and three.replicas()["primary-0"]["state"] == "ready", 60, "restart")
    assert three.replicas()["primary-0"]["pid"] != victim
    assert three.events("replica_failed", "primary-0")
    assert ok_fraction(fire(three.url, texts(30, "again"), concurrency=3)) == 1.0
    assert 'vllm_srun_replica_restarts{deployment="primary",replica="primary-0"} 1.0' in \
        three.client.get("/metrics").text


def test_sigstop_stays_out_of_dispatch_and_sigcont_recovers(three):
    """A stopped worker answers neither requests nor /health: its first timeout backs it off
    and its probes keep failing, so it stays out of dispatch until it answers again."""
    victim = three.replicas()["primary-2"]["pid"]
    os.kill(victim, signal.SIGSTOP)
    try:
        results = fire(three.url, texts(300, "stop"), concurrency=6)
        assert three.replicas()["primary-2"]["state"] in ("backoff", "ejected")
        three.wait_for(lambda: any(e["reason"] == "health probe failed"
                                   for e in three.events("replica_probed", "primary-2")),
                       5, "a failed probe of the stopped worker")
    finally:
        os.kill(victim, signal.SIGCONT)
    assert ok_fraction(results) >= ALL_OK_FRACTION
    assert {s for s, _, _ in results} <= {200, 504}
    three.wait_for(lambda: three.replicas()["primary-2"]["state"] == "ready", 15, "recovery")
    assert ok_fraction(fire(three.url, texts(30, "cont"), concurrency=3)) == 1.0


def test_slow_on_every_replica_keeps_them_all(three):
    for r in ("primary-0", "primary-1", "primary-2"):
        three.fault(r, "slow 1200")
    results = fire(three.url, texts(24, "slow"), concurrency=6)
    assert {s for s, _, _ in results} == {504}
    assert not three.events("replica_ejected")
    withheld = three.events("replica_ejection_withheld")
    assert withheld and all("no other ready replica has answered" in e["reason"]
                            for e in withheld)
    assert all(r["state"] != "ejected" for r in three.replicas().values())
    for r in ("primary-0", "primary-1", "primary-2"):
        three.fault(r, None)
    time.sleep(3.5)  # a duration, not a proof: the slow forwards the workers still hold finish
    assert ok_fraction(fire(three.url, texts(30, "fast"), concurrency=3)) == 1.0


def test_burst_over_admission_gets_429_at_once(tmp_path):
    """100 requests at once on 2 workers (admission 2 x 32) whose forwards take a second: the
    refused ones are answered before any admitted one, i.e. without waiting in a queue.
    (Relative, in one run: no absolute timing in tests.)"""
    from bench.rawclient import Conn

    server = PoolServer(tmp_path, {"primary": cpu_deployment(2)})
    try:
        server.wait_ready()
        server.wait_all_ready(n=2)
        server.fault("all", "slow 1000")

        async def burst():
            conns = [await Conn.open(server.url) for _ in range(100)]  # opened beforehand
            start = time.monotonic()

            async def one(i, conn):
                status, head, body = await conn.post(
                    "/v1/embeddings", b'{"input": "burst %d"}' % i)
                return status, time.monotonic() - start, head, body

            try:
                return await asyncio.gather(*(one(i, c) for i, c in enumerate(conns)))
            finally:
                for c in conns:
                    c.close()

        results = asyncio.run(burst())
        statuses = [r[0] for r in results]
        assert set(statuses) == {200, 429}
        assert statuses.count(200) >= 64  # 32 per worker were admitted
        refused = [r for r in results if r[0] == 429]
        for _, _, head, body in refused:
            assert orjson.loads(body)["error"]["code"] == "overloaded"
            assert head["retry-after"] == "1"
        slowest_refusal = max(r[1] for r in refused)
        first_answer = min(r[1] for r in results if r[0] == 200)
        assert slowest_refusal < first_answer, (slowest_refusal, first_answer)
        assert 'outcome="overloaded"' in server.client.get("/metrics").text
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attached_endpoints_refusing_and_incompatible(tmp_path, l6_server):
    refused = f"http://127.0.0.1:{free_port()}"
    deployments = {
        "primary": {"artifact": L6, "engine": {"num_threads": 1, "max_num_seqs": 32},
                    "replicas": [{"device": "cpu"},
                                 {"endpoint": l6_server.url, "model": L6},
                                 {"endpoint": refused, "model": L6}]},
        "strict": {"artifact": L6, "engine": {"max_num_seqs": 16},
                   "replicas": [{"endpoint": l6_server.url, "model": L6}]}}
    server = PoolServer(tmp_path, deployments, bound="primary")
    try:
        server.wait_for(lambda: server.replicas()["primary-0"]["state"] == "ready"
                        and server.replicas()["primary-1"]["state"] == "ready", 60, "ready")
        down = server.replicas()["primary-2"]
        assert down["state"] == "failed" and "cannot be reached" in down["reason"]
        (strict,) = server.replicas("strict").values()
        assert strict["state"] == "incompatible"
        assert strict["reason"] == "reports max_num_seqs=32 (set 16)"
        results = fire(server.url, texts(40, "attached"), concurrency=4)
        assert ok_fraction(results) == 1.0
        direct = l6_server.client.post("/v1/embeddings", json={"input": "attached request "
                                                               "number 3 about replicas"})
        pooled = next(b for s, _, b in results if True)
        assert pooled["data"][0]["embedding"]
        assert np.allclose(results[3][2]["data"][0]["embedding"],
                           direct.json()["data"][0]["embedding"], atol=1e-6)
        refused_strict = server.client.post("/v1/embeddings", json={"input": "x",
                                                                     "model": "strict"})
        assert refused_strict.status_code == 503
        assert "incompatible" in refused_strict.json()["error"]["message"]
        inv = {d["name"]: d for d in server.inventory()["deployments"]}
        assert inv["primary"]["state"] == "degraded" and inv["primary"]["ready"] == 2
        assert inv["strict"]["state"] == "unavailable"
    finally:
        server.close()


def test_reconfiguration_keeps_identities_and_binding_changes_restart_nothing(tmp_path):
    deployments = {"a": cpu_deployment(2), "b": cpu_deployment(1)}
    server = PoolServer(tmp_path, deployments, bound="a")
    try:
        server.wait_ready()
        server.wait_all_ready("a", 2)
        server.wait_all_ready("b", 1)
        pids = {r["id"]: r["pid"] for d in ("a", "b") for r in server.replicas(d).values()}
        starts = len(server.events("replica_starting"))

        server.reload(deployments, bound="b")  # bindings only
        server.wait_for(lambda: next(d for d in server.inventory()["deployments"]
                                     if d["name"] == "b")["bound"], 30, "binding moved")
        assert len(server.events("replica_starting")) == starts
        assert {r["id"]: r["pid"] for d in ("a", "b")
                for r in server.replicas(d).values()} == pids

        grown = {"a": cpu_deployment(3), "b": cpu_deployment(1)}
        load = []
        server.reload(grown, bound="b")
        load = fire(server.url, texts(200, "reconf"), concurrency=4, model="a")
        server.wait_all_ready("a", 3)
        a = server.replicas("a")
        assert {k: a[k]["pid"] for k in ("a-0", "a-1")} == {k: pids[k] for k in ("a-0", "a-1")}
        assert "a-2" in a

        server.reload({"a": cpu_deployment(1), "b": cpu_deployment(1)}, bound="b")
        server.wait_for(lambda: list(server.replicas("a")) == ["a-0"], 30, "shrink")
        assert server.replicas("a")["a-0"]["pid"] == pids["a-0"]
        server.wait_for(lambda: len(server.events("replica_stopped")) == 2, 30, "drained")
        assert {e["replica"] for e in server.events("replica_draining")} == {"a-1", "a-2"}
        load += fire(server.url, texts(50, "after-shrink"), concurrency=4, model="a")
        assert ok_fraction(load) == 1.0

        (tmp_path / "config.yaml").write_text("global: {colour: blue}")
        server.proc.send_signal(signal.SIGHUP)  # a bad config changes nothing
        (failed,) = server.wait_for(lambda: server.events("reconfiguration_failed"), 30,
                                    "the refusal")
        assert "global.model_catalog" in failed["reason"]  # the key that is wrong
        assert list(server.replicas("a")) == ["a-0"]
        assert server.replicas("a")["a-0"]["pid"] == pids["a-0"]
        assert ok_fraction(fire(server.url, texts(5, "still"), concurrency=2)) == 1.0
    finally:
        server.close()


def test_seed_config_on_cpu_devices_serves_with_owner_only_sockets(tmp_path):
    """The seed's placement example with ``cpu`` devices; VLLM_SRUN_CPU_THREADS applies per
    worker; worker sockets live in an owner-only folder (R7.3); both workers hold a slot of
    the host's core ledger (R4.12)."""
    from tests.conftest import SEED_PLACEMENT

    text = SEED_PLACEMENT.replace("rocm:0", "cpu").replace("rocm:1", "cpu").replace(
        "vllm-sr/d3-edge", L6)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    server = Server("--config", str(path), env={"VLLM_SRUN_CPU_THREADS": "1"}).wait_ready()
    try:
        inv = PoolServer.inventory(server)
        (dep,) = inv["deployments"]
        assert dep["desired"] == 2
        for r in dep["replicas"]:
            cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes().split(b"\0")
            sock = Path(cmdline[cmdline.index(b"--socket") + 1].decode())
            assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0
        threads = server.client.get("/v1/threads").json()["reports"]
        assert [(rep["deployment"], rep["configured_threads"]) for rep in threads] == \
            [("primary", 1), ("primary", 1)]
        # R4.12: the CPU workers share the host's cores through one ledger beside the record
        share = CoreShare.open(cores_path(default_record_path(data_dir())), 2, "test")
        try:
            assert {r["pid"] for r in dep["replicas"]} <= {s.pid for s in share.slots()}
        finally:
            share.close()
        body = server.client.post("/v1/embeddings", json={"input": ["a", "b"]}).json()
        assert len(body["data"]) == 2
    finally:
        server.close()


def test_workers_do_not_outlive_a_killed_front_end(tmp_path):
    server = PoolServer(tmp_path, {"primary": cpu_deployment(2)})
    server.wait_ready()
    server.wait_all_ready(n=2)
    pids = [r["pid"] for r in server.replicas().values()]
    server.proc.kill()
    server.proc.wait()
    end = time.monotonic() + 20
    while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if Path(f"/proc/{p}/status").exists()
             and "zombie" not in Path(f"/proc/{p}/status").read_text()]
    server.client.close()
    assert not alive, f"workers {alive} outlived their front end"


def test_a_reload_asking_a_pool_of_workers_for_forwards_at_once_changes_nothing(tmp_path):
    """Several forwards at once apply to a one-worker deployment; a reload that asks them of
    a deployment of worker processes is refused naming the key, and the pool keeps serving
    as it was."""
    server = PoolServer(tmp_path, {"primary": cpu_deployment(1)}).wait_ready()
    try:
        server.wait_all_ready("primary", 1)
        pid = server.replicas()["primary-0"]["pid"]
        server.reload({"primary": cpu_deployment(2, concurrent_forwards=2)})
        (failed,) = server.wait_for(lambda: server.events("reconfiguration_failed"), 30,
                                    "the refusal")
        assert "engine.concurrent_forwards (--concurrent-forwards) 2" in failed["reason"]
        assert "one-worker deployment" in failed["reason"]
        assert list(server.replicas()) == ["primary-0"]
        assert server.replicas()["primary-0"]["pid"] == pid
        assert ok_fraction(fire(server.url, texts(5, "still"), concurrency=2)) == 1.0
    finally:
        server.close()


def test_a_worker_keeps_an_idle_connection_open_past_the_front_ends_expiry(tmp_path):
    """The front end reuses an idle connection to a worker for ``IDLE_EXPIRY_S``; a worker
    that closed it at the same moment made the front end send on a closing connection ("Server
    disconnected without sending a response", a 503 to the caller under a 10x soak). Over the
    worker's own socket: a request, then the front end's whole expiry idle and a second of
    margin, then a second request on the same connection is answered."""
    from vllm_srun.server.pool.replicas.process import IDLE_EXPIRY_S

    server = PoolServer(tmp_path, {"primary": cpu_deployment(1)})
    try:
        server.wait_ready()
        server.wait_all_ready(n=1)
        pid = server.replicas()["primary-0"]["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        path = cmdline[cmdline.index(b"--socket") + 1].decode()
        request = b"GET /health HTTP/1.1\r\nHost: worker\r\n\r\n"
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            for _ in range(2):
                s.sendall(request)
                got = b""
                while b"\r\n\r\n" not in got and (chunk := s.recv(65536)):
                    got += chunk
                head, _, body = got.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), got  # b"": the worker closed it
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                while len(body) < length and (chunk := s.recv(65536)):
                    body += chunk
                assert len(body) == length
                time.sleep(IDLE_EXPIRY_S + 1.0)
    finally:
        server.close()
