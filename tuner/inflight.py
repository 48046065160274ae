"""What runs now (R4.5): the served forwards and the shadow in flight, as the tuner's
bookkeeping sees them (always under the tuner's lock, never held across a forward).

A shadow's time is a sample only if no served forward ran at any moment of it, and a served
forward's time only if no shadow ran beside it unfrozen: each side counts its starts and ends
(``epoch``, ``shadow_epoch``), so an unchanged epoch across a forward says nothing on the
other side started or ended meanwhile (``policy.clean_window``, ``Timed.alone``). Where a
worker runs several served forwards at once (``concurrent_forwards``), their counts together
stay within ``cores`` where they can (``room``), and a served forward's time is a sample only
if no other served forward ran beside it (``solo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_srun.runtime.types import TokenBatch
from vllm_srun.tuner.scheduling import ShadowJob


@dataclass(frozen=True)
class Timed:
    """What a served forward found at its start, read back when it ends."""

    froze: bool  # it froze the shadow side
    alone: bool  # no shadow could run at its start (frozen, or none running)
    shadow_epoch: int  # ``InFlight.shadow_epoch`` then
    contention: str | None  # "fallback": served below the learned count (free cores)
    sampling: bool  # its time may be a sample (its range explores, or is new)
    chosen: int = 0  # the count the tuner chose for it (the core ledger may serve less)
    busy: int = 0  # served forwards running then, itself included (``InFlight.busy``)
    epoch: int = -1  # ``InFlight.epoch`` then, its own start included


NOT_TIMED = Timed(False, False, -1, None, False)


@dataclass(frozen=True)
class ShadowStart:
    """A due shadow the tuner started (``AdaptiveThreads.step``), read back when it ends."""

    lo: int  # its size range
    job: ShadowJob
    count: int
    sharing: bool  # it waited for a gap on the served forwards' cores
    paid: bool  # the learning share pays for it
    epoch: int  # ``InFlight.epoch`` then
    began_s: float
    frozen_s: float  # ``Freezer.frozen_total`` then


@dataclass
class InFlight:
    cores: int = 1  # the CPU budget the worker's served forwards share
    busy: int = 0  # served forwards running now
    epoch: int = 0  # served forwards started plus ended
    shadowing: int = 0  # shadow forwards running now
    shadow_epoch: int = 0  # shadow forwards started plus ended
    shadow_threads: int = 0  # the count of the shadow running now
    shadow_gated: bool = False  # ... it waited for a gap (``ShadowGate.next_shadow``)
    shadow_paid: bool = False  # ... it is a paid one: never frozen
    shadow_lo: int = 0  # ... and its range (``AdaptiveThreads._shadow_starved``)
    # a paid shadow that times a count runs in the served forwards' place: while it runs
    # (until it ends, or ``held_until`` at the latest) and while it waits for those running
    # to end (``claim_until``), a served forward about to start waits (the tuner's clock;
    # ``ShadowSteps.wait_for_timing_shadow``)
    held_until: float = 0.0
    claim_until: float = 0.0
    # served forwards running: id(batch) -> what it found at its start
    timed: dict[int, Timed] = field(default_factory=dict)

    def served_started(self) -> bool:
        """A served forward starts; returns whether none was running (an idle gap ends)."""
        first = not self.busy
        self.busy += 1
        self.epoch += 1
        return first

    def served_ended(self, batch: TokenBatch) -> Timed:
        """A served forward ended: what it found at its start (``NOT_TIMED`` if unknown)."""
        self.busy = max(0, self.busy - 1)
        self.epoch += 1
        return self.timed.pop(id(batch), NOT_TIMED)

    def claimed(self, now: float) -> bool:
        """No served forward runs, and a paid shadow that times a count claims their place."""
        return not self.busy and self.claim_until > now

    def room(self) -> int:
        """The threads a served forward about to start may take beside the served forwards
        running now (several at once: ``concurrent_forwards``)."""
        return self.cores - sum(t.chosen for t in self.timed.values())

    def solo(self, timed: Timed) -> bool:
        """No other served forward ran at any moment of one that just ended: none ran at its
        start, and none started or ended since (its own end is the one step)."""
        return timed.busy == 1 and self.epoch == timed.epoch + 1

    def alone(self, timed: Timed) -> bool:
        """No shadow ran beside a served forward unfrozen: it froze the shadow side, or none
        could run at its start and none started or ended since."""
        return timed.froze or (timed.alone and timed.shadow_epoch == self.shadow_epoch)

    def sharing(self, count: int, top: int) -> bool:
        """The shadow running now waited for a gap on cores a served forward at ``count``
        needs too (their sum over ``top``)."""
        return bool(self.shadowing) and self.shadow_gated and self.shadow_threads + count > top

    def shadow_began(self, lo: int, gated: bool, paid: bool) -> None:
        """A due shadow of range ``lo`` is about to run."""
        self.shadow_gated, self.shadow_paid, self.shadow_lo = gated, paid, lo

    def shadow_started(self, count: int) -> None:
        self.shadowing += 1
        self.shadow_epoch += 1
        self.shadow_threads = count

    def shadow_ended(self) -> None:
        self.shadowing -= 1
        self.shadow_epoch += 1
