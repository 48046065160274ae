"""Which count the engine's scheduler thread should be a lane of (its *home*; ``engine``).

A forward at a count other than the scheduler's home is handed to that count's lane and
back. ``HomeWatch`` counts the counts forwards were served at; after ``HOME_WINDOW`` of them,
where at least ``HOME_SHARE`` ran at one other count (mode 2 once it learned), it names that
count, and the engine moves its loop to a new thread whose home it is.
"""

from __future__ import annotations

# Each forward handed to another count's lane waited 0.6-0.7 ms for that lane to wake on a
# busy 2-vCPU host (mode 2 at 16 connections: 2.4-2.9% of the time, ``bench/engine_split.py``);
# a move costs one forward on a new thread's cold team. A window of a few seconds of traffic
# at tens of forwards a second, and a share well over half, so that a mix near even never
# moves it back and forth.
HOME_WINDOW = 128
HOME_SHARE = 0.75


class HomeWatch:
    """The counts the last forwards of one scheduler thread (home ``home``) ran at."""

    def __init__(self, home: int) -> None:
        self.home = home
        self.served: dict[int, int] = {}

    def served_at(self, n: int) -> int | None:
        """A forward ran at ``n``: the count to move home to, once a window shows one."""
        self.served[n] = self.served.get(n, 0) + 1
        if sum(self.served.values()) < HOME_WINDOW:
            return None
        served, self.served = self.served, {}
        top = max(served, key=served.__getitem__)
        return top if top != self.home and served[top] >= HOME_SHARE * HOME_WINDOW else None
