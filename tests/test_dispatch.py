"""Dispatch, admission and the reconfiguration plan (R5.2, R5.3, R5.10) as the pure rules they
are, then through one deployment's request path. The fault tests in test_pool.py drive the
same code with real workers."""

from __future__ import annotations

import asyncio

import pytest

from vllm_srun.server.pool import dispatch
from vllm_srun.server.pool.config import validate
from vllm_srun.server.pool.deployment_pool import DeploymentPool
from vllm_srun.server.pool.dispatch import MAX_IN_FLIGHT, Load
from vllm_srun.server.pool.errors import PoolError, Refusal
from vllm_srun.server.pool.flags import single
from vllm_srun.server.pool.outlier import Outcome, OutlierPolicy, OutlierSettings
from vllm_srun.server.pool.plan import DeploymentShape, Slot, plan
from vllm_srun.server.pool.pool import Pool, PoolOptions
from vllm_srun.server.pool.replicas import AttachedReplica, LoadAccount
from vllm_srun.server.pool.states import ReplicaState

# -- the rules --------------------------------------------------------------------------------


def test_fewest_outstanding_bytes_wins():
    loads = [Load("a", 1, 1000, 1), Load("b", 1, 10, 2), Load("c", 1, 20, 3)]
    assert dispatch.choose(loads).replica_id == "b"


def test_ties_go_to_the_least_recently_assigned():
    loads = [Load("a", 0, 0, 5), Load("b", 0, 0, 3), Load("c", 0, 0, 4)]
    assert dispatch.choose(loads).replica_id == "b"


def test_a_full_replica_admits_nothing_and_all_full_is_overload():
    full = Load("a", MAX_IN_FLIGHT, 0, 1)
    assert not dispatch.admits(full)
    assert dispatch.choose([full, Load("b", MAX_IN_FLIGHT - 1, 99, 2)]).replica_id == "b"
    assert dispatch.choose([full, Load("b", MAX_IN_FLIGHT, 0, 2)]) is None


def test_round_robin_ignores_bytes():
    loads = [Load("a", 0, 0, 5), Load("b", 0, 1000, 1)]
    assert dispatch.choose(loads, round_robin=True).replica_id == "b"


def shape(key: str, *placements: str) -> DeploymentShape:
    return DeploymentShape((key,), tuple((p, None) for p in placements))


def test_plan_keeps_unchanged_placements_in_order_and_retires_the_rest():
    old = {"d": (shape("k", "cpu", "cpu", "cuda:0"),
                 [("d-0", ("cpu", None)), ("d-1", ("cpu", None)), ("d-2", ("cuda:0", None))])}
    chosen = plan(old, {"d": shape("k", "cpu", "cuda:1")})
    assert chosen.slots["d"] == (Slot(0, "d-0"), Slot(1, None))
    assert chosen.retired == ("d-1", "d-2")


def test_plan_replaces_every_worker_when_shared_settings_change():
    old = {"d": (shape("k", "cpu"), [("d-0", ("cpu", None))])}
    chosen = plan(old, {"d": shape("other engine args", "cpu")})
    assert chosen.slots["d"] == (Slot(0, None),) and chosen.retired == ("d-0",)


def test_plan_of_a_binding_only_change_starts_and_retires_nothing():
    old = {"a": (shape("k", "cpu"), [("a-0", ("cpu", None))]),
           "b": (shape("j", "cpu"), [("b-0", ("cpu", None))])}
    chosen = plan(old, {"a": shape("k", "cpu"), "b": shape("j", "cpu")})
    assert chosen.kept() == {"a-0", "b-0"} and chosen.retired == ()


# -- one deployment's request path ------------------------------------------------------------


class Placeholder:
    """A replica that carries only what dispatch reads: a state and a load account."""

    def __init__(self, rid: str) -> None:
        self.id, self.state, self.account = rid, ReplicaState.READY, LoadAccount(rid)
        self.reason = None

    def load(self) -> Load:
        a = self.account
        return Load(self.id, a.in_flight, a.outstanding_bytes, a.last_assigned)


def pool_of(n: int) -> DeploymentPool:
    counter = iter(range(1, 10**6))
    replicas = [Placeholder(f"r{i}") for i in range(n)]
    policy = OutlierPolicy(OutlierSettings(), lambda: 0.0)
    for r in replicas:
        policy.add(r.id)
    return DeploymentPool("d", None, None, replicas, policy, lambda: next(counter),
                          lambda *a: None)


def test_picks_spread_by_bytes_and_then_by_recency():
    pool = pool_of(3)
    order = [pool.pick(0).id for _ in range(6)]  # zero bytes: every pick is a tie
    assert order == ["r0", "r1", "r2", "r0", "r1", "r2"]
    big = pool.pick(1000)
    assert {pool.pick(5).id for _ in range(2)} == {"r0", "r1", "r2"} - {big.id}


def test_admission_is_32_per_worker_then_overloaded():
    pool = pool_of(2)
    for _ in range(2 * MAX_IN_FLIGHT):
        pool.pick(1)
    assert pool.can_admit() is False
    with pytest.raises(PoolError) as exc:
        pool.pick(1)
    assert exc.value.refusal is Refusal.OVERLOADED


def test_only_ready_replicas_take_requests():
    pool = pool_of(3)
    pool.replicas[0].state = ReplicaState.INCOMPATIBLE
    pool.replicas[1].state = ReplicaState.DRAINING
    assert {pool.pick(0).id for _ in range(4)} == {"r2"}
    pool.replicas[2].state = ReplicaState.STARTING
    assert pool.can_admit() is None
    with pytest.raises(PoolError) as exc:
        pool.pick(0)
    assert exc.value.refusal is Refusal.NOT_READY and "r0: incompatible" in exc.value.message


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
        await pool.start(config)
        (a,), (b,) = pool.deployments["a"].replicas, pool.deployments["b"].replicas
        a.state = b.state = ReplicaState.READY
        pool.deployments["a"].pick(100)
        await pool.close()
        return a, b

    a, b = asyncio.run(build())
    assert isinstance(a, AttachedReplica) and a.account is b.account
    assert b.account.in_flight == 1 and b.account.outstanding_bytes == 100


def test_pool_is_saturated_only_when_no_replica_can_admit():
    pool = Pool(PoolOptions(budget=2))
    dep = pool_of(2)
    pool.config, pool.deployments = single("all-MiniLM-L6-v2"), {"primary": dep}
    for _ in range(2 * MAX_IN_FLIGHT - 1):
        dep.pick(1)
    assert not pool.saturated()
    dep.pick(1)
    assert pool.saturated()  # the front end now refuses before parsing (admission)
    for r in dep.replicas:
        r.state = ReplicaState.STARTING
    assert not pool.saturated()  # no ready replica: the handler answers 503 with reasons
