"""The replica pool (R5): dispatch, admission, backoff and ejection, supervision, inventory and
reconfiguration, for every deployment of the config.

- Dispatch (R5.2): the ready replica with the fewest outstanding request bytes, ties to the
  least recently assigned. Load is accounted per physical worker: two deployments that attach
  the same endpoint share one account.
- Admission (R5.3): at most 32 in flight per worker, no pool queue: when every replica that
  may take requests is full, 429 ``overloaded`` with ``Retry-After`` at once.
- Backoff, probes and ejection (R5.5, R5.6) follow :mod:`vllm_srun.server.outlier`; a monitor task
  readmits on cool-down and runs the ``/health`` probes.
- A request is dispatched once. Only when nothing was done (the worker could not be reached,
  or refused) does it try one other replica.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.budget import configured_threads
from vllm_srun.runtime.errors import ConfigError, RuntimeFault
from vllm_srun.runtime.types import EngineArgs, Task, TextInput, input_chars
from vllm_srun.server.config import Config, DeploymentConfig, ReplicaConfig
from vllm_srun.server.deployment import Deployment, DeploymentSpec
from vllm_srun.server.outlier import Event, Outcome, OutlierPolicy, OutlierSettings
from vllm_srun.server.replicas import (
    STARTUP_TIMEOUT_S,
    AttachedReplica,
    ExchangeError,
    LoadAccount,
    LocalReplica,
    ProcessReplica,
    Replica,
)

log = logging.getLogger("vllm_srun.pool")

MAX_IN_FLIGHT = 32
DISPATCH_ENV = "VLLM_SRUN_DISPATCH"  # "round_robin": only for the bench's comparison
MONITOR_S = 0.05
EVENTS_KEPT = 500
PROVISIONAL_SEQS, PROVISIONAL_TOKENS = 32, 8192


class PoolError(Exception):
    """A request the pool cannot place: 429 overloaded, 503 no ready replica, 404 unknown."""

    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to check and shape a request for a deployment."""

    name: str
    artifact: str
    task: Task
    hidden_size: int | None
    labels: tuple[str, ...]
    revision: str | None
    max_tokens: int | None


@dataclass
class PoolOptions:
    """Process-wide settings every managed worker inherits."""

    budget: int
    mode: int = 0
    max_threads: int | None = None
    record: str | None = None
    log_level: str = "warning"
    socket_dir: str | None = None


def _deployment_key(dep: DeploymentConfig) -> tuple:
    """What replicas of a deployment share: changing any of it replaces its workers."""
    return (dep.artifact, dep.backend, dep.engine)


def _placement_key(r: ReplicaConfig) -> tuple:
    return (r.device, r.endpoint, r.model)


def dispatch_mode() -> str:
    """``bytes`` (the rule, R5.2) unless the bench asks for ``round_robin`` to compare."""
    mode = os.environ.get(DISPATCH_ENV, "bytes") or "bytes"
    if mode not in ("bytes", "round_robin"):
        raise ConfigError(f"{DISPATCH_ENV} must be 'bytes' or 'round_robin', got {mode!r}")
    return mode


class DeploymentPool:
    def __init__(self, name: str, config: DeploymentConfig, info: ModelInfo,
                 replicas: list[Replica], policy: OutlierPolicy, seq: Callable[[], int],
                 count: Callable[[str, str, str], None]) -> None:
        self.name, self.config, self.info = name, config, info
        self.replicas = replicas
        self.policy = policy
        self._seq = seq
        self._count = count
        self.round_robin = dispatch_mode() == "round_robin"

    def ready_ids(self) -> list[str]:
        return [r.id for r in self.replicas if r.state == "ready"]

    def pick(self, nbytes: int, exclude: frozenset[str] = frozenset()) -> Replica:
        ready = [r for r in self.replicas if r.state == "ready" and r.id not in exclude]
        if not ready:
            states = ", ".join(f"{r.id}: {r.state}" + (f" ({r.reason})" if r.reason else "")
                               for r in self.replicas)
            raise PoolError(503, "not_ready", f"deployment {self.name!r} has no ready replica "
                                              f"[{states}]", {"Retry-After": "1"})
        (tier,) = self.policy.dispatch_tiers([r.id for r in ready])
        open_ = [r for r in ready if r.id in tier and r.account.in_flight < MAX_IN_FLIGHT]
        if not open_:
            self._count(self.name, "-", "overloaded")
            raise PoolError(429, "overloaded",
                            f"deployment {self.name!r}: every ready replica has "
                            f"{MAX_IN_FLIGHT} requests in flight", {"Retry-After": "1"})
        if self.round_robin:
            chosen = min(open_, key=lambda r: r.account.last_assigned)
        else:
            chosen = min(open_, key=lambda r: (r.account.outstanding_bytes,
                                               r.account.last_assigned))
        acct = chosen.account
        acct.in_flight += 1
        acct.outstanding_bytes += nbytes
        acct.last_assigned = self._seq()
        return chosen

    def _settle(self, replica: Replica, nbytes: int, outcome: Outcome) -> None:
        replica.account.in_flight -= 1
        replica.account.outstanding_bytes -= nbytes
        self._count(self.name, replica.id, outcome.value)
        self.policy.report(replica.id, outcome, self.ready_ids())

    async def infer(self, texts: list[TextInput], truncate: bool,
                    caller_deadline: float | None = None,
                    field: str = "input") -> tuple[np.ndarray, int, str]:
        """Dispatch one request as one unit; returns (rows, prompt tokens, replica id).

        The exchange's deadline is the deployment's ``timeout_ms`` or the caller's own
        (monotonic) deadline, whichever comes first. Running past the caller's shorter
        deadline counts toward ``consecutive_timeouts`` but causes no backoff (R5.5)."""
        limit = time.monotonic() + self.config.engine.timeout_ms / 1000
        caller_shorter = caller_deadline is not None and caller_deadline < limit
        deadline = caller_deadline if caller_shorter else limit
        if deadline <= time.monotonic():  # no exchange: it neither counts nor resets
            raise ExchangeError(Outcome.NOT_SENT, 504, "deadline_exceeded",
                                "deadline passed before the request reached a replica")
        nbytes = input_chars(texts)
        tried: set[str] = set()
        while True:
            replica = self.pick(nbytes, frozenset(tried))
            try:
                out, tokens = await replica.call(texts, truncate, deadline, field)
            except ExchangeError as exc:
                outcome = exc.outcome
                if outcome is Outcome.TIMEOUT and caller_shorter:
                    outcome = Outcome.DEADLINE
                self._settle(replica, nbytes, outcome)
                tried.add(replica.id)
                if exc.retry_elsewhere and len(tried) < 2 and any(
                        r.state == "ready" and r.id not in tried for r in self.replicas):
                    continue
                raise
            except asyncio.CancelledError:
                self._settle(replica, nbytes, Outcome.CANCELLED)
                raise
            except BaseException:
                self._settle(replica, nbytes, Outcome.FAILURE)
                raise
            self._settle(replica, nbytes, Outcome.SUCCESS)
            return out, tokens, replica.id

    def state(self) -> str:
        ready = sum(1 for r in self.replicas if r.state == "ready")
        if ready == len(self.replicas):
            return "ready"
        if ready:
            return "degraded"
        return "starting" if any(r.state == "starting" for r in self.replicas) else "unavailable"

    def replica_state(self, r: Replica) -> str:
        if r.state != "ready":
            return r.state
        return self.policy.state_of(r.id) or "ready"

    def inventory(self, bound: bool) -> dict:
        replicas = []
        for r in self.replicas:
            h = self.policy.replicas.get(r.id)
            replicas.append({
                "id": r.id, "device": r.placement, **r.describe(),
                "state": self.replica_state(r), "reason": r.reason,
                "in_flight": r.account.in_flight,
                "outstanding_bytes": r.account.outstanding_bytes, "restarts": r.restarts,
                "limits": r.limits,
                "consecutive_timeouts": h.consecutive_timeouts if h else 0,
                "ejections": h.total_ejections if h else 0,
                "readmissions": h.total_readmissions if h else 0})
        ready = sum(1 for r in self.replicas if self.replica_state(r) == "ready")
        return {"name": self.name, "artifact": self.config.artifact, "bound": bound,
                "model": self.info.name, "revision": self.info.revision,
                "desired": len(self.replicas), "ready": ready, "state": self.state(),
                "outlier_detection": self.config.outlier_detection.model_dump(),
                "replicas": replicas}


@dataclass
class Pool:
    """Every deployment of the config, with shared load accounts and one event log."""

    options: PoolOptions
    metrics: object = None
    clock: Callable[[], float] = time.monotonic
    on_forward: Callable | None = None
    on_load_failure: Callable[[str], None] | None = None
    config: Config | None = None
    deployments: dict[str, DeploymentPool] = field(default_factory=dict)
    accounts: dict[str, LoadAccount] = field(default_factory=dict)
    events: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=EVENTS_KEPT))

    def __post_init__(self) -> None:
        self._seq_n = 0
        self._ids = collections.Counter()
        self._socket_dir = self.options.socket_dir or tempfile.mkdtemp(
            prefix="vllm-srun-workers-")
        os.chmod(self._socket_dir, 0o700)  # R7.3: only the owner can reach the sockets
        self._probing: set[str] = set()
        self._monitor: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._socket_n = 0

    # -- building ---------------------------------------------------------------------------

    def _seq(self) -> int:
        self._seq_n += 1
        return self._seq_n

    def _event(self, kind: str, deployment: str, replica: str, reason: str, **extra) -> None:
        entry = {"event": kind, "deployment": deployment, "replica": replica,
                 "reason": reason, "at": round(time.time(), 3), **extra}
        self.events.append(entry)
        if self.metrics is not None:
            self.metrics.pool_event(kind, deployment, replica)

    def _count(self, deployment: str, replica: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.exchanges.labels(deployment, replica, outcome).inc()

    def _info(self, name: str, dep: DeploymentConfig) -> tuple[ModelInfo, object | None]:
        try:
            m = resolve(dep.artifact)
        except RuntimeFault:
            if all(r.endpoint for r in dep.placements()):
                return ModelInfo(dep.artifact, dep.artifact, Task.EMBED, None, (), None,
                                 None), None
            raise
        return ModelInfo(m.name, dep.artifact, m.task, m.hidden_size, m.labels, m.revision,
                         m.max_tokens), m

    def _engine_args(self, dep: DeploymentConfig) -> EngineArgs:
        e = dep.engine
        return EngineArgs(num_threads=configured_threads(self.options.budget, e.num_threads),
                          max_num_seqs=e.max_num_seqs or PROVISIONAL_SEQS,
                          max_num_batched_tokens=e.max_num_batched_tokens or PROVISIONAL_TOKENS,
                          timeout_ms=e.timeout_ms, cache_entries=e.cache_entries)

    def _new_replica(self, name: str, dep: DeploymentConfig, r: ReplicaConfig,
                     manifest) -> Replica:
        n = self._ids[name]
        self._ids[name] += 1
        rid = f"{name}-{n}"
        expected = {k: v for k, v in (("max_num_seqs", dep.engine.max_num_seqs),
                                      ("max_num_batched_tokens",
                                       dep.engine.max_num_batched_tokens)) if v is not None}

        def transition(rep: Replica, state: str, reason: str, _name: str = name) -> None:
            log.info("replica_%s deployment=%s replica=%s reason=%r", state, _name, rep.id,
                     reason)
            self._event(f"replica_{state}", _name, rep.id, reason)

        if r.endpoint is not None:
            account = self.accounts.setdefault(r.endpoint, LoadAccount(r.endpoint))
            return AttachedReplica(rid, r.endpoint, account, expected, transition,
                                   endpoint=r.endpoint, model=r.model)
        account = LoadAccount(rid)
        self.accounts[rid] = account
        args = self._engine_args(dep)
        backend = dep.backend or "onnxruntime"
        if dep.shorthand:
            from vllm_srun.tuner.modes import AdaptiveMode

            spec = DeploymentSpec(dep.artifact, backend, args, self.options.budget,
                                  AdaptiveMode(self.options.mode), self.options.max_threads,
                                  self.options.record, device=r.device,
                                  set_max_num_seqs=dep.engine.max_num_seqs,
                                  set_max_num_batched_tokens=dep.engine.max_num_batched_tokens,
                                  calibrate=True)
            return LocalReplica(rid, r.device, account, expected, transition,
                                deployment=Deployment(spec, manifest),
                                on_forward=self.on_forward,
                                on_load_failure=self.on_load_failure)
        self._socket_n += 1
        spec = {"model": dep.artifact, "backend": backend, "device": r.device,
                "args": {"num_threads": args.num_threads, "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens,
                         "timeout_ms": args.timeout_ms, "cache_entries": args.cache_entries},
                "max_num_seqs": dep.engine.max_num_seqs,
                "max_num_batched_tokens": dep.engine.max_num_batched_tokens,
                "budget": self.options.budget, "mode": self.options.mode,
                "max_threads": self.options.max_threads, "record": self.options.record}
        return ProcessReplica(rid, r.device, account, expected, transition,
                              socket_path=os.path.join(self._socket_dir,
                                                       f"w{self._socket_n}.sock"),
                              spec=spec, log_level=self.options.log_level)

    def _policy(self, name: str, dep: DeploymentConfig) -> OutlierPolicy:
        o = dep.outlier_detection
        settings = OutlierSettings(o.consecutive_timeouts, o.base_ejection_ms,
                                   o.max_ejection_ms, o.max_ejection_percent)

        def on_event(e: Event, _name: str = name) -> None:
            extra = {"ejection_ms": e.ejection_ms} if e.ejection_ms is not None else {}
            self._event(e.kind, _name, e.replica_id, e.reason, **extra)

        return OutlierPolicy(settings, self.clock, on_event)

    def _plan(self, config: Config) -> tuple[dict[str, DeploymentPool], list[Replica],
                                             list[Replica]]:
        """The pool for ``config``: (deployments, new replicas to start, retired replicas).
        Replicas whose deployment kept its artifact, backend and engine arguments and whose
        placement is still declared keep their identity (R5.10)."""
        built: dict[str, DeploymentPool] = {}
        fresh: list[Replica] = []
        kept_ids: set[str] = set()
        for name, dep in config.deployments.items():
            old = self.deployments.get(name)
            reusable: list[Replica] = []
            if old is not None and _deployment_key(old.config) == _deployment_key(dep) \
                    and old.config.shorthand == dep.shorthand:
                reusable = list(old.replicas)
            info, manifest = ((old.info, None) if reusable else self._info(name, dep))
            policy = self._policy(name, dep)
            replicas = []
            for placement in dep.placements():
                match = next((r for r in reusable
                              if r.placement == (placement.device or placement.endpoint)
                              and getattr(r, "model", None) == placement.model), None)
                if match is not None:
                    reusable.remove(match)
                    kept_ids.add(match.id)
                    replicas.append(match)
                    policy.replicas[match.id] = old.policy.replicas.get(match.id) \
                        or policy.add(match.id)
                else:
                    rep = self._new_replica(name, dep, placement, manifest)
                    fresh.append(rep)
                    replicas.append(rep)
                    policy.add(rep.id)
            built[name] = DeploymentPool(name, dep, info, replicas, policy, self._seq,
                                         self._count)
        retired = [r for d in self.deployments.values() for r in d.replicas
                   if r.id not in kept_ids]
        return built, fresh, retired

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, config: Config) -> None:
        """Publish the pool at once and start its workers in the background (the server
        answers 503 until a deployment has a ready replica)."""
        built, fresh, _ = self._plan(config)
        self.deployments, self.config = built, config
        for r in fresh:
            await r.start()
        self._monitor = asyncio.create_task(self._watch(), name="pool-monitor")

    async def reconfigure(self, config: Config, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """Prepare the new pool, publish it atomically, then drain retired workers (R5.10).
        A pool that cannot be prepared (a new worker not ready or incompatible) is not
        published: the old one keeps serving and ConfigError says why."""
        async with self._lock:
            built, fresh, retired = self._plan(config)
            for r in fresh:
                await r.start()
            settled = await asyncio.gather(*(r.settled(timeout_s) for r in fresh))
            failed = [r for r, ok in zip(fresh, settled, strict=True) if not ok]
            if failed:
                for r in fresh:
                    await r.stop()
                    if r.kind != "attached":
                        self.accounts.pop(r.account.key, None)
                reasons = "; ".join(f"{r.id}: {r.state} ({r.reason})" for r in failed)
                self._event("reconfiguration_refused", "-", "-", reasons)
                raise ConfigError(f"new pool not published: {reasons}")
            self.deployments, self.config = built, config  # publish: one assignment
            for r in retired:
                r.transition("draining", "retired by reconfiguration")
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
        r.transition("stopped", "drained")
        if r.kind != "attached" or not any(
                x.account is r.account for d in self.deployments.values() for x in d.replicas):
            self.accounts.pop(r.account.key, None)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await asyncio.gather(*(r.stop() for d in self.deployments.values()
                               for r in d.replicas), return_exceptions=True)
        with contextlib.suppress(OSError):
            os.rmdir(self._socket_dir)

    async def _watch(self) -> None:
        """Readmit replicas whose cool-down ended and run due ``/health`` probes."""
        while True:
            await asyncio.sleep(MONITOR_S)
            now = self.clock()
            for dep in list(self.deployments.values()):
                dep.policy.expire(now)
                for r in dep.replicas:
                    h = dep.policy.replicas.get(r.id)
                    if h is None or r.id in self._probing or r.state != "ready":
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

    # -- requests ---------------------------------------------------------------------------

    def deployment_for(self, model: str | None) -> DeploymentPool:
        """The deployment a request names (by deployment name or served model), else the
        bound one (``system.decision_model``)."""
        if self.config is None:
            raise PoolError(503, "not_ready", "the pool is starting", {"Retry-After": "1"})
        if model is None:
            return self.deployments[self.config.bound]
        dep = self.deployments.get(model)
        if dep is not None:
            return dep
        for d in self.deployments.values():
            if model in (d.info.name, d.config.artifact):
                return d
        names = sorted({*self.deployments, *(d.info.name for d in self.deployments.values())})
        raise PoolError(404, "model_not_found", f"model {model!r} is not served here; "
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
        """True when no deployment has a replica that could admit one more request (the
        front end then refuses before parsing anything)."""
        if self.config is None:
            return False
        for dep in self.deployments.values():
            ready = [r for r in dep.replicas if r.state == "ready"]
            if not ready:
                return False  # let the handler give its 503 with the reasons
            (tier,) = dep.policy.dispatch_tiers([r.id for r in ready])
            if any(r.id in tier and r.account.in_flight < MAX_IN_FLIGHT for r in ready):
                return False
        return True

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
