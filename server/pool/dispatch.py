"""Which replica takes a request, and whether one may (R5.2, R5.3): pure functions over frozen
snapshots of the replicas' load, written once for the pool and for Ray's request router.

- Admission: a replica admits while it has fewer than ``MAX_IN_FLIGHT`` requests in flight;
  there is no pool queue, so when none admits the answer is overload at once.
- Choice: among the replicas that admit, the fewest outstanding request bytes, ties to the
  least recently assigned (``round_robin``: least recently assigned only, for the bench).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_IN_FLIGHT = 32


@dataclass(frozen=True)
class Load:
    """One candidate replica's load account, as dispatch sees it."""

    replica_id: str
    in_flight: int
    outstanding_bytes: int
    last_assigned: int  # a sequence number; 0 = never


def admits(load: Load) -> bool:
    return load.in_flight < MAX_IN_FLIGHT


def order_key(load: Load) -> tuple[int, int]:
    """The dispatch order: fewest outstanding bytes, then least recently assigned."""
    return (load.outstanding_bytes, load.last_assigned)


def choose(candidates: Sequence[Load], round_robin: bool = False) -> Load | None:
    """The replica a request goes to, or None when every candidate is full."""
    open_ = [c for c in candidates if admits(c)]
    if not open_:
        return None
    return min(open_, key=(lambda c: c.last_assigned) if round_robin else order_key)


def overload_message(deployment: str) -> str:
    return f"deployment {deployment!r}: every ready replica has {MAX_IN_FLIGHT} requests in flight"
