"""Dispatch and admission (R5.2, R5.3) on the pool's own selection code.

The replicas here are placeholders that only carry a state and a load account: the thing
under test is the pool's choice, which reads nothing else. The fault tests in test_pool.py
drive the same code with real workers.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_srun.server.config import validate
from vllm_srun.server.outlier import Outcome, OutlierPolicy, OutlierSettings
from vllm_srun.server.pool import MAX_IN_FLIGHT, DeploymentPool, Pool, PoolError, PoolOptions
from vllm_srun.server.replicas import AttachedReplica, LoadAccount


class Placeholder:
    def __init__(self, rid: str) -> None:
        self.id, self.state, self.account = rid, "ready", LoadAccount(rid)
        self.reason = None


def pool_of(n: int, clock=lambda: 0.0) -> DeploymentPool:
    counter = iter(range(1, 10**6))
    replicas = [Placeholder(f"r{i}") for i in range(n)]
    policy = OutlierPolicy(OutlierSettings(), clock)
    for r in replicas:
        policy.add(r.id)
    return DeploymentPool("d", None, None, replicas, policy, lambda: next(counter),
                          lambda *a: None)


def test_fewest_outstanding_bytes_wins():
    pool = pool_of(3)
    first = pool.pick(1000)
    second = pool.pick(10)
    third = pool.pick(10)
    assert len({first.id, second.id, third.id}) == 3
    fourth = pool.pick(10)  # r1 and r2 hold 10 bytes, r0 holds 1000
    assert fourth.id in (second.id, third.id)
    assert pool.pick(5).id != first.id


def test_ties_go_to_the_least_recently_assigned():
    pool = pool_of(3)
    order = []
    for _ in range(6):
        r = pool.pick(0)  # zero bytes: every pick is a tie
        order.append(r.id)
    assert order == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_settle_releases_the_account_and_reports_the_outcome():
    pool = pool_of(2)
    r = pool.pick(300)
    assert (r.account.in_flight, r.account.outstanding_bytes) == (1, 300)
    pool._settle(r, 300, Outcome.TIMEOUT)
    assert (r.account.in_flight, r.account.outstanding_bytes) == (0, 0)
    assert pool.policy.replicas[r.id].consecutive_timeouts == 1


def test_admission_is_32_per_worker_then_429_with_retry_after():
    pool = pool_of(2)
    for _ in range(2 * MAX_IN_FLIGHT):
        pool.pick(1)
    with pytest.raises(PoolError) as exc:
        pool.pick(1)
    assert exc.value.status == 429 and exc.value.code == "overloaded"
    assert exc.value.headers == {"Retry-After": "1"}


def test_only_ready_replicas_take_requests():
    pool = pool_of(3)
    pool.replicas[0].state = "incompatible"
    pool.replicas[1].state = "draining"
    assert {pool.pick(0).id for _ in range(4)} == {"r2"}
    pool.replicas[2].state = "starting"
    with pytest.raises(PoolError) as exc:
        pool.pick(0)
    assert exc.value.status == 503 and "r0: incompatible" in exc.value.message


def test_backed_off_replica_is_skipped_while_another_can_serve():
    pool = pool_of(2)
    pool.policy.report("r0", Outcome.FAILURE, ["r0", "r1"])
    assert {pool.pick(0).id for _ in range(3)} == {"r1"}


def test_deployments_attaching_one_endpoint_share_one_load_account():
    config = validate({"global": {"model_catalog": {"deployments": {
        "a": {"artifact": "x", "replicas": [{"endpoint": "http://127.0.0.1:9", "model": "m"}]},
        "b": {"artifact": "y", "replicas": [{"endpoint": "http://127.0.0.1:9/",
                                             "model": "m2"}]}}}}})

    async def build():
        pool = Pool(PoolOptions(budget=2))
        deployments, fresh, _ = pool._plan(config)
        for r in fresh:
            await r.client.aclose()
        return deployments

    deployments = asyncio.run(build())
    (a,), (b,) = deployments["a"].replicas, deployments["b"].replicas
    assert isinstance(a, AttachedReplica) and a.account is b.account
    a.state = b.state = "ready"
    a_pick = deployments["a"].pick(100)
    assert b.account.in_flight == 1 and a_pick.account.outstanding_bytes == 100


def test_pool_is_saturated_only_when_no_replica_can_admit():
    from vllm_srun.server.config import single

    pool = Pool(PoolOptions(budget=2))
    dep = pool_of(2)
    pool.config, pool.deployments = single("all-MiniLM-L6-v2"), {"primary": dep}
    for _ in range(2 * MAX_IN_FLIGHT - 1):
        dep.pick(1)
    assert not pool.saturated()
    dep.pick(1)
    assert pool.saturated()  # the front end now refuses before parsing (AdmissionGate)
    for r in dep.replicas:
        r.state = "starting"
    assert not pool.saturated()  # no ready replica: the handler answers 503 with reasons
