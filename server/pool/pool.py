"""The replica pool (R5): every deployment of the config, its replicas' lifecycle, the monitor
that readmits and probes, inventory and reconfiguration.

- Dispatch and admission are :mod:`dispatch`'s rules, applied per deployment by
  :class:`DeploymentPool`; load is accounted per physical worker, so two deployments that
  attach the same endpoint share one account.
- Backoff, probes and ejection (R5.5, R5.6) follow :mod:`outlier`; a monitor task readmits on
  cool-down and runs the due ``/health`` probes.
- Reconfiguration (R5.10) follows :mod:`plan`: the new pool is prepared, published in one
  assignment, and retired replicas drain. Each new replica is made by :mod:`replica_factory`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.errors import ConfigError, RuntimeFault
from vllm_srun.runtime.types import Manifest, Task
from vllm_srun.server.pool import plan as planning
from vllm_srun.server.pool.config import Config, DeploymentConfig, replica_key_path
from vllm_srun.server.pool.deployment_pool import DeploymentPool, ModelInfo, listed_ids, served_ids
from vllm_srun.server.pool.errors import PoolError, Refusal
from vllm_srun.server.pool.outlier import Event, Outcome, OutlierPolicy, OutlierSettings
from vllm_srun.server.pool.replica_factory import (
    PoolOptions,
    ReplicaFactory,
    check_concurrent_forwards,
)
from vllm_srun.server.pool.replicas import LoadAccount, LocalReplica, Replica
from vllm_srun.server.pool.replicas.base import STARTUP_TIMEOUT_S
from vllm_srun.server.pool.states import ReplicaState

log = logging.getLogger("vllm_srun.pool")

DISPATCH_ENV = "VLLM_SRUN_DISPATCH"  # "round_robin": only for the bench's comparison
MONITOR_S = 0.05
EVENTS_KEPT = 500


class Observer(Protocol):
    """Where the pool's events and exchange outcomes are counted (the front end's metrics)."""

    def pool_event(self, kind: str, deployment: str, replica: str) -> None: ...

    def exchange(self, deployment: str, replica: str, outcome: str) -> None: ...


def dispatch_mode() -> str:
    """``bytes`` (the rule, R5.2) unless the bench asks for ``round_robin`` to compare."""
    mode = os.environ.get(DISPATCH_ENV, "bytes") or "bytes"
    if mode not in ("bytes", "round_robin"):
        raise ConfigError(f"{DISPATCH_ENV} must be 'bytes' or 'round_robin', got {mode!r}")
    return mode


def _shape(dep: DeploymentConfig) -> planning.DeploymentShape:
    """What the plan compares: shared settings (changing any replaces the workers) and the
    declared placements."""
    return planning.DeploymentShape(
        (dep.artifact, dep.revision, dep.backend, dep.engine, dep.adaptive_threads,
         dep.shorthand, dep.dtype, dep.quality_gate),
        tuple((r.device or r.endpoint, r.model) for r in dep.placements()))


def _model_info(dep: DeploymentConfig) -> tuple[ModelInfo, Manifest | None]:
    """What the front end knows of ``dep``'s model; its id is ``served_model_name`` if set."""
    served = dep.served_names[0] if dep.served_names else None
    try:
        m = resolve(dep.artifact, dep.revision)
    except RuntimeFault:
        if all(r.endpoint for r in dep.placements()):  # attached only: nothing local
            return ModelInfo(served or dep.artifact, dep.artifact, Task.EMBED, None, (), None,
                             None, dep.artifact, dep.revision), None
        raise
    return ModelInfo(served or m.name, dep.artifact, m.task, m.hidden_size, m.labels,
                     m.revision, m.max_tokens, m.name, dep.revision, m), m


@dataclass
class Pool:
    """Every deployment of the config, with shared load accounts and one event log."""

    options: PoolOptions
    observer: Observer | None = None
    clock: Callable[[], float] = time.monotonic
    on_load_failure: Callable[[str], None] | None = None
    config: Config | None = None
    deployments: dict[str, DeploymentPool] = field(default_factory=dict)
    accounts: dict[str, LoadAccount] = field(default_factory=dict)
    events: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=EVENTS_KEPT))

    def __post_init__(self) -> None:
        self._seq_n = 0
        self._replicas = ReplicaFactory(self.options, self.accounts, self.on_load_failure)
        self._probing: set[str] = set()
        self._monitor: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._round_robin = dispatch_mode() == "round_robin"

    # -- events -----------------------------------------------------------------------------

    def _seq(self) -> int:
        self._seq_n += 1
        return self._seq_n

    def _event(self, kind: str, deployment: str, replica: str, reason: str, **extra) -> None:
        entry = {"event": kind, "deployment": deployment, "replica": replica,
                 "reason": reason, "at": round(time.time(), 3), **extra}
        self.events.append(entry)
        if self.observer is not None:
            self.observer.pool_event(kind, deployment, replica)

    def record_event(self, kind: str, reason: str) -> None:
        """A pool-wide event (no deployment or replica), e.g. a refused reconfiguration."""
        self._event(kind, "-", "-", reason)

    def _count(self, deployment: str, replica: str, outcome: str) -> None:
        if self.observer is not None:
            self.observer.exchange(deployment, replica, outcome)

    # -- building replicas ------------------------------------------------------------------

    def _on_transition(self, deployment: str) -> Callable[[Replica, ReplicaState, str], None]:
        def transition(rep: Replica, state: ReplicaState, reason: str) -> None:
            log.info("replica_%s deployment=%s replica=%s reason=%r", state, deployment,
                     rep.id, reason)
            self._event(f"replica_{state}", deployment, rep.id, reason)
        return transition

    def _policy(self, name: str, dep: DeploymentConfig) -> OutlierPolicy:
        o = dep.outlier_detection
        settings = OutlierSettings(o.consecutive_timeouts, o.base_ejection_ms,
                                   o.max_ejection_ms, o.max_ejection_percent)

        def on_event(e: Event, _name: str = name) -> None:
            extra = {"ejection_ms": e.ejection_ms} if e.ejection_ms is not None else {}
            self._event(e.kind, _name, e.replica_id, e.reason, **extra)

        return OutlierPolicy(settings, self.clock, on_event)

    def _build(self, config: Config) -> tuple[dict[str, DeploymentPool], list[Replica],
                                              list[Replica]]:
        """The pool for ``config`` as :func:`plan.plan` decides it: (deployments, fresh
        replicas to start, retired replicas)."""
        check_concurrent_forwards(self.options, config)
        shapes = {name: _shape(d.config) for name, d in self.deployments.items()}
        old = {name: (shapes[name], list(zip((r.id for r in d.replicas),
                                             shapes[name].placements, strict=True)))
               for name, d in self.deployments.items()}
        chosen = planning.plan(old, {n: _shape(d) for n, d in config.deployments.items()})
        by_id = {r.id: (d, r) for d in self.deployments.values() for r in d.replicas}
        built, fresh = {}, []
        for name, dep in config.deployments.items():
            slots = chosen.slots[name]
            kept = [by_id[s.keep] for s in slots if s.keep]
            info, manifest = (kept[0][0].info, None) if kept else _model_info(dep)
            info = dataclasses.replace(info, name=(dep.served_names or (None,))[0]
                                       or info.model_name or info.name)
            policy = self._policy(name, dep)
            replicas = []
            for slot in slots:
                if slot.keep:
                    old_dep, rep = by_id[slot.keep]
                    policy.replicas[rep.id] = old_dep.policy.replicas.get(rep.id) \
                        or policy.add(rep.id)
                else:
                    placement = dep.placements()[slot.index]
                    rep = self._replicas.new(name, dep, placement, manifest,
                                             replica_key_path(name, dep, slot.index),
                                             self._on_transition(name))
                    rep.expected_revision = info.revision
                    fresh.append(rep)
                    policy.add(rep.id)
                replicas.append(rep)
            built[name] = DeploymentPool(name, dep, info, replicas, policy, self._seq,
                                         self._count, self._round_robin)
        return built, fresh, [by_id[rid][1] for rid in chosen.retired]

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, config: Config) -> None:
        """Publish the pool at once and start its workers in the background (the server
        answers 503 until a deployment has a ready replica)."""
        built, fresh, _ = self._build(config)
        self.deployments, self.config = built, config
        for r in fresh:
            await r.start()
        self._monitor = asyncio.create_task(self._watch(), name="pool-monitor")

    async def _discard(self, fresh: list[Replica]) -> None:
        for r in fresh:
            await r.stop()
            if r.kind != "attached":
                self.accounts.pop(r.account.key, None)

    async def reconfigure(self, config: Config, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """Prepare the new pool, publish it atomically, then drain retired workers (R5.10).
        A pool that cannot be prepared (a new worker not ready or incompatible) is not
        published: the old one keeps serving and ConfigError says why."""
        async with self._lock:
            built, fresh, retired = self._build(config)
            for r in fresh:
                await r.start()
            settled = await asyncio.gather(*(r.settled(timeout_s) for r in fresh))
            failed = [r for r, ok in zip(fresh, settled, strict=True) if not ok]
            if failed:
                await self._discard(fresh)
                reasons = "; ".join(f"{r.id}: {r.state} ({r.reason})" for r in failed)
                self._event("reconfiguration_refused", "-", "-", reasons)
                raise ConfigError(f"new pool not published: {reasons}")
            self.deployments, self.config = built, config  # publish: one assignment
            for r in retired:
                r.transition(ReplicaState.DRAINING, "retired by reconfiguration")
                asyncio.create_task(self._drain(r), name=f"drain-{r.id}")
            summary = {"started": [r.id for r in fresh], "retired": [r.id for r in retired],
                       "kept": [r.id for d in built.values() for r in d.replicas
                                if r not in fresh]}
            self._event("reconfigured", "-", "-", str(summary))
            return summary

    async def _drain(self, r: Replica, limit_s: float = 60.0) -> None:
        end = time.monotonic() + limit_s
        while r.account.in_flight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await r.stop()
        r.transition(ReplicaState.STOPPED, "drained")
        if r.kind != "attached" or not any(
                x.account is r.account for d in self.deployments.values() for x in d.replicas):
            self.accounts.pop(r.account.key, None)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await asyncio.gather(*(r.stop() for r in self.replicas()), return_exceptions=True)
        self._replicas.close()

    async def _watch(self) -> None:
        """Readmit replicas whose cool-down ended and run due ``/health`` probes."""
        while True:
            await asyncio.sleep(MONITOR_S)
            now = self.clock()
            for dep in list(self.deployments.values()):
                dep.policy.expire(now)
                for r in dep.replicas:
                    h = dep.policy.replicas.get(r.id)
                    if h is None or r.id in self._probing or r.state != ReplicaState.READY:
                        continue
                    if h.probe_ready(now):
                        self._probing.add(r.id)
                        asyncio.create_task(self._probe(dep, r), name=f"probe-{r.id}")

    async def _probe(self, dep: DeploymentPool, r: Replica) -> None:
        try:
            ok = await r.probe()
            self._event("replica_probed", dep.name, r.id, "health ok" if ok else
                        "health probe failed")
            if ok:
                dep.policy.probe_passed(r.id)
            else:
                dep.policy.report(r.id, Outcome.FAILURE, dep.ready_ids())
        finally:
            self._probing.discard(r.id)

    # -- requests and views -----------------------------------------------------------------

    def replicas(self) -> list[Replica]:
        return [r for d in self.deployments.values() for r in d.replicas]

    def deployment_for(self, model: str | None) -> DeploymentPool:
        """The deployment a request names (by deployment name or served model), else the
        bound one (``system.decision_model``)."""
        if self.config is None:
            raise PoolError(Refusal.NOT_READY, "the pool is starting")
        if model is None:
            return self.deployments[self.config.bound]
        dep = self.deployments.get(model)
        if dep is not None:
            return dep
        for d in self.deployments.values():
            if model in served_ids(d.name, d.config, d.info):
                return d
        names = sorted({*self.deployments, *(n for d in self.deployments.values()
                                             for n in listed_ids(d.config, d.info))})
        raise PoolError(Refusal.UNKNOWN_MODEL, f"model {model!r} is not served here; "
                                               f"served: {names}")

    def ready(self) -> tuple[bool, str]:
        """Ready when every deployment has a replica that can take requests."""
        if self.config is None:
            return False, "starting"
        waiting = [f"{d.name}: " + ", ".join(f"{r.id} {r.state}" + (
            f" ({r.reason})" if r.reason else "") for r in d.replicas)
            for d in self.deployments.values() if not d.ready_ids()]
        return (not waiting, "; ".join(waiting))

    def saturated(self) -> bool:
        """True when every deployment has ready replicas and none could admit one more
        request (the front end then refuses before parsing anything)."""
        if self.config is None:
            return False
        return all(d.can_admit() is False for d in self.deployments.values())

    def local_replica(self) -> LocalReplica | None:
        """The in-process replica of the bound deployment, if it is the shorthand."""
        if self.config is None:
            return None
        reps = self.deployments[self.config.bound].replicas
        return reps[0] if len(reps) == 1 and isinstance(reps[0], LocalReplica) else None

    def inventory(self) -> dict:
        bound = self.config.bound if self.config else None
        return {"deployments": [d.inventory(d.name == bound)
                                for d in self.deployments.values()],
                "events": list(self.events)[-100:]}
