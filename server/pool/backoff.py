"""The one doubling rule behind every wait of the pool: a replica's backoff after a timeout or
failure (0.1 s doubling to 3.2 s, R5.5), a crashed worker's restart and an unreachable
endpoint's next attach (0.5 s doubling to 30 s, R5.9)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Doubling:
    start_s: float
    max_s: float

    def next(self, current_s: float) -> float:
        """The wait after ``current_s`` (0 = none yet): the start, then twice the last, capped."""
        return self.start_s if current_s <= 0 else min(2 * current_s, self.max_s)


REPLICA_BACKOFF = Doubling(0.1, 3.2)
RESTART = Doubling(0.5, 30.0)
