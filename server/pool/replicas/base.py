"""What every replica kind shares: its load account, its state and the compatibility rule.

Each kind answers :meth:`Replica.call` with ``(rows, prompt_tokens)`` or raises
:class:`ExchangeError`, which says how the exchange ended so the pool can count timeouts and
back off.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from vllm_srun.runtime.types import TextInput
from vllm_srun.server.pool.dispatch import Load
from vllm_srun.server.pool.states import ReplicaState

STARTUP_TIMEOUT_S = 600.0


@dataclass
class LoadAccount:
    """The load estimate of one physical worker, shared by everything dispatched to it."""

    key: str
    in_flight: int = 0
    outstanding_bytes: int = 0
    last_assigned: int = 0


def incompatibility(expected_limits: Mapping[str, int], expected_revision: str | None,
                    limits: Mapping[str, int] | None, revision: str | None) -> str | None:
    """Why a replica must stay out of dispatch (R5.4): batch limits other than the ones set,
    or another revision of the artifact than its deployment's; None when it may serve."""
    if expected_revision and revision and revision != expected_revision:
        return (f"serves revision {revision} of the artifact; the deployment's is "
                f"{expected_revision}")
    if limits is not None:
        wrong = [f"{k}={limits.get(k)} (set {v})" for k, v in expected_limits.items()
                 if limits.get(k) != v]
        if wrong:
            return "reports " + ", ".join(wrong)
    return None


class Replica(abc.ABC):
    """One replica behind the pool's dispatch; the kinds implement the exchange."""

    kind = "replica"

    def __init__(self, replica_id: str, placement: str, account: LoadAccount,
                 expected_limits: dict[str, int],
                 on_transition: Callable[[Replica, ReplicaState, str], None]) -> None:
        self.id = replica_id
        self.placement = placement          # device (cpu, cuda:0) or endpoint URL
        self.account = account
        self.expected_limits = expected_limits  # the limits the deployment sets (R5.4)
        self.expected_revision: str | None = None  # the deployment's artifact revision
        self.state = ReplicaState.STARTING
        self.reason: str | None = "starting"
        self.restarts = 0
        self.limits: dict[str, int] | None = None
        self.precision: dict | None = None  # what a managed worker serves in, and why (R1.5)
        self.pid: int | None = None
        self._on_transition = on_transition
        self._settled = asyncio.Event()

    def load(self) -> Load:
        a = self.account
        return Load(self.id, a.in_flight, a.outstanding_bytes, a.last_assigned)

    def transition(self, state: ReplicaState, reason: str | None) -> None:
        if state == self.state and reason == self.reason:
            return
        self.state, self.reason = state, reason
        if state.settled:
            self._settled.set()
        self._on_transition(self, state, reason or "")

    def admit(self, limits: dict[str, int] | None, revision: str | None = None) -> None:
        """Ready, or incompatible (with the reason) per :func:`incompatibility`."""
        self.limits = limits
        reason = incompatibility(self.expected_limits, self.expected_revision, limits, revision)
        if reason is not None:
            return self.transition(ReplicaState.INCOMPATIBLE, reason)
        self.transition(ReplicaState.READY, None)

    async def settled(self, timeout_s: float) -> bool:
        """Wait until the replica is no longer starting; True when ready."""
        try:
            await asyncio.wait_for(self._settled.wait(), timeout_s)
        except TimeoutError:
            return False
        return self.state == ReplicaState.READY

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin loading or attaching; returns at once (``settled`` waits)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the worker (or detach) and release its resources."""

    @abc.abstractmethod
    async def probe(self) -> bool:
        """One health probe: True when the replica says it is ready."""

    @abc.abstractmethod
    async def call(self, texts: list[TextInput], truncate: bool, deadline: float,
                   field: str = "input", raw: bool = False) -> tuple[np.ndarray, int]:
        """One exchange: (rows, prompt tokens), or ExchangeError saying how it ended.
        ``texts`` may hold text pairs (reranking); ``field`` names them in errors; ``raw``
        asks for the rows before the model's last step (``protocol.Work.raw``)."""

    async def threads_report(self) -> dict:
        return {"notes": [f"{self.kind} replicas manage their own threads"]}

    async def metrics_text(self) -> str | None:
        """The worker's own Prometheus metrics (``replica``-labelled), if it has any."""
        return None

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid}
