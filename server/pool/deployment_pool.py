"""One deployment's replicas behind one dispatch (R5.2-R5.6): the request path.

``infer`` sends a request as one unit to the replica :func:`dispatch.choose` picks among the
ready ones the outlier policy lets take requests, settles its load account, and reports how
the exchange ended to the policy. A request is dispatched once; only when nothing was done
(the worker could not be reached, or refused) does it try one other replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm_srun.runtime.types import Manifest, Task, TextInput, input_chars
from vllm_srun.server.pool import dispatch
from vllm_srun.server.pool.config import DeploymentConfig
from vllm_srun.server.pool.errors import ExchangeError, PoolError, Refusal
from vllm_srun.server.pool.outlier import Outcome, OutlierPolicy
from vllm_srun.server.pool.replicas import Replica
from vllm_srun.server.pool.states import DeploymentState, ReplicaState
from vllm_srun.server.worker.trace import current as current_trace


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
    model_name: str | None = None  # the artifact's own name, which served_model_name replaces
    hub_revision: str | None = None  # the deployment's Hub revision (a Hub id artifact)
    manifest: Manifest | None = None  # None for a deployment of attached endpoints only


def served_ids(name: str, config: DeploymentConfig, info: ModelInfo) -> tuple[str, ...]:
    """The model ids a request may send for deployment ``name``: the deployment's name and
    the ids ``/v1/models`` lists; without ``served_model_name`` also the artifact as the
    config spells it. ``served_model_name``'s names replace the model's own ids, as vLLM's
    ``--served-model-name`` does."""
    if config.served_names:
        return (name, *config.served_names)
    return (name, info.name, config.artifact)


def listed_ids(config: DeploymentConfig, info: ModelInfo) -> tuple[str, ...]:
    """The ids ``/v1/models`` lists for a deployment: every served name, else the model's."""
    return config.served_names or (info.name,)


class DeploymentPool:
    """The pool's view of one deployment of the config (``DeploymentConfig``)."""

    def __init__(self, name: str, config: DeploymentConfig, info: ModelInfo,
                 replicas: list[Replica], policy: OutlierPolicy, seq: Callable[[], int],
                 count: Callable[[str, str, str], None], round_robin: bool = False) -> None:
        self.name, self.config, self.info = name, config, info
        self.replicas = replicas
        self.policy = policy
        self._seq = seq
        self._count = count
        self.round_robin = round_robin

    def precision(self) -> dict:
        """``dtype`` as configured and, once a managed worker chose, its ``precision`` report
        (what serves, why, the quality gate's thresholds and figures, R1.5): a ready one's
        first, else any (a refused one says why). Nothing for attached endpoints: they
        report their own."""
        if all(r.endpoint for r in self.config.placements()):
            return {}
        reports = sorted((r for r in self.replicas if r.precision),
                         key=lambda r: r.state != ReplicaState.READY)
        out: dict = {"dtype": self.config.dtype or "float32"}
        if reports:
            out["precision"] = reports[0].precision
        return out

    def ready_ids(self) -> list[str]:
        return [r.id for r in self.replicas if r.state == ReplicaState.READY]

    def _tier(self, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The ready replicas dispatch may use now (ejected or backing-off ones only when no
        other can take requests)."""
        ready = [r for r in self.replicas if r.state == ReplicaState.READY
                 and r.id not in exclude]
        if not ready:
            return []
        (tier,) = self.policy.dispatch_tiers([r.id for r in ready])
        return [r for r in ready if r.id in tier]

    def can_admit(self) -> bool | None:
        """True when a replica could admit one more request, False when all are full, None
        when no replica is ready (the request path then says why)."""
        tier = self._tier()
        return any(dispatch.admits(r.load()) for r in tier) if tier else None

    def pick(self, nbytes: int, exclude: frozenset[str] = frozenset()) -> Replica:
        tier = self._tier(exclude)
        if not tier:
            states = ", ".join(f"{r.id}: {r.state}" + (f" ({r.reason})" if r.reason else "")
                               for r in self.replicas)
            raise PoolError(Refusal.NOT_READY,
                            f"deployment {self.name!r} has no ready replica [{states}]")
        chosen = dispatch.choose([r.load() for r in tier], self.round_robin)
        if chosen is None:
            self._count(self.name, "-", Refusal.OVERLOADED.value)
            raise PoolError(Refusal.OVERLOADED, dispatch.overload_message(self.name))
        replica = next(r for r in tier if r.id == chosen.replica_id)
        acct = replica.account
        acct.in_flight += 1
        acct.outstanding_bytes += nbytes
        acct.last_assigned = self._seq()
        return replica

    def _settle(self, replica: Replica, nbytes: int, outcome: Outcome) -> None:
        replica.account.in_flight -= 1
        replica.account.outstanding_bytes -= nbytes
        self._count(self.name, replica.id, outcome.value)
        self.policy.report(replica.id, outcome, self.ready_ids())

    def _deadline(self, caller_deadline: float | None) -> tuple[float, bool]:
        """The exchange's deadline and whether it is the caller's (shorter) own."""
        limit = time.monotonic() + self.config.engine.timeout_ms / 1000
        caller_shorter = caller_deadline is not None and caller_deadline < limit
        return (caller_deadline if caller_shorter else limit), caller_shorter

    async def infer(self, texts: list[TextInput], truncate: bool,
                    caller_deadline: float | None = None, field: str = "input",
                    raw: bool = False) -> tuple[np.ndarray, int, str]:
        """Dispatch one request as one unit; returns (rows, prompt tokens, replica id).
        ``raw``: the rows before the model's last step (see ``Work.raw``).
        Running past the caller's shorter deadline counts toward ``consecutive_timeouts`` but
        causes no backoff (R5.5)."""
        deadline, caller_shorter = self._deadline(caller_deadline)
        if deadline <= time.monotonic():  # no exchange: it neither counts nor resets
            raise ExchangeError(Outcome.NOT_SENT, "deadline_exceeded",
                                "deadline passed before the request reached a replica")
        nbytes = input_chars(texts)
        tried: set[str] = set()
        while True:
            replica = self.pick(nbytes, frozenset(tried))
            try:
                out, tokens = await replica.call(texts, truncate, deadline, field, raw)
            except ExchangeError as exc:
                outcome = exc.outcome
                if outcome is Outcome.TIMEOUT and caller_shorter:
                    outcome = Outcome.DEADLINE
                self._settle(replica, nbytes, outcome)
                exc.replica_id = replica.id
                tried.add(replica.id)
                if exc.retry_elsewhere and len(tried) < 2 and self._tier(frozenset(tried)):
                    continue
                raise
            except asyncio.CancelledError:
                self._settle(replica, nbytes, Outcome.CANCELLED)
                raise
            except BaseException:
                self._settle(replica, nbytes, Outcome.FAILURE)
                raise
            self._settle(replica, nbytes, Outcome.SUCCESS)
            if (trace := current_trace()) is not None:
                trace.deployment, trace.tokens = self.name, trace.tokens + tokens
            return out, tokens, replica.id

    def state(self) -> DeploymentState:
        ready = sum(1 for r in self.replicas if r.state == ReplicaState.READY)
        if ready == len(self.replicas):
            return DeploymentState.READY
        if ready:
            return DeploymentState.DEGRADED
        if any(r.state == ReplicaState.STARTING for r in self.replicas):
            return DeploymentState.STARTING
        return DeploymentState.UNAVAILABLE

    def replica_state(self, r: Replica) -> ReplicaState:
        if r.state != ReplicaState.READY:
            return r.state
        return self.policy.state_of(r.id) or ReplicaState.READY

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
        ready = sum(1 for r in self.replicas if self.replica_state(r) == ReplicaState.READY)
        return {"name": self.name, "artifact": self.config.artifact, "bound": bound,
                "model": self.info.name, "revision": self.info.revision,
                "desired": len(self.replicas), "ready": ready, "state": self.state(),
                "outlier_detection": self.config.outlier_detection.model_dump(),
                "replicas": replicas}
