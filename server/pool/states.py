"""The pool's states (R5.8), one vocabulary for inventory, metrics and dispatch."""

from __future__ import annotations

import enum


class ReplicaState(enum.StrEnum):
    STARTING = "starting"          # the worker is loading (or the endpoint being attached)
    READY = "ready"                # takes requests (unless backoff or ejection says not now)
    BACKOFF = "backoff"            # out of dispatch after a timeout or failure, until probed
    EJECTED = "ejected"            # out of dispatch for its ejection time (R5.6)
    INCOMPATIBLE = "incompatible"  # reports other batch limits or another revision (R5.4)
    UNAUTHORIZED = "unauthorized"  # an attached endpoint refused our key
    DRAINING = "draining"          # retired by reconfiguration, finishing its requests
    FAILED = "failed"              # exited, unreachable, or refused by a start-up check
    STOPPED = "stopped"            # drained and stopped

    @property
    def settled(self) -> bool:
        """No longer starting: reconfiguration can tell whether the new pool is usable."""
        return self in (ReplicaState.READY, ReplicaState.INCOMPATIBLE,
                        ReplicaState.UNAUTHORIZED, ReplicaState.FAILED)


class DeploymentState(enum.StrEnum):
    READY = "ready"              # every replica ready
    DEGRADED = "degraded"        # some replicas ready: still serving
    STARTING = "starting"        # none ready yet, some starting
    UNAVAILABLE = "unavailable"  # none ready, none starting
