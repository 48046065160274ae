"""What learning may spend (R4.5 amended): idle CPU, and a bounded paid share of serving.

``ShadowBudget``: shadows in the idle class take at most ``fraction`` of wall time, charged
by the CPU they took (wall time less time frozen or waiting for CPUs), as a leaky bucket that
banks idle time for ``window_s`` at most (an idle hour let half an hour of shadows run at
once when it banked without a cap).

``PaidShare``: where traffic leaves no idle CPU, a due shadow that has starved (see
``scheduling.ShadowGate.starved``) may run at normal priority beside served forwards: it
takes CPU from them, so it is paid from a bucket that fills at ``share`` of served forward
time (default 2%), holds at most ``cap_s``, and is charged the CPU the paid shadow took.
In mode 2 (``per_range``) each size range also pays from a bucket of its own that fills at
``share`` of *its* served forward time: what learning a range costs the served forwards is
bounded by what the range carries, since only its own forwards gain from its count. From one
bucket for all, under steady load from 16 connections, the share went on at 2% of served
time two minutes after the ranges carrying the load had learned, on the rare batches of
exactly 512 padded tokens (60-75 ms a shadow) and of 8-15 tokens, ranges that carried well
under 1% of the forward time. Mode 1 keeps one bucket: what it learns is for the report, and
every range the traffic reaches is to be timed in bounded time. A shadow is charged
its wall time less its threads' run delay per thread (a thread waiting for a CPU takes none
from served forwards; on a host that other tasks load, charged its wall time, a 2-thread
paid shadow of 25 ms ran 0.5 s and spent a minute's share). A paid shadow starts only while
the bucket holds its expected cost. Invariant: paid seconds never exceed ``share`` of the
served forward seconds so far plus ``cap_s`` plus what the last paid shadow ran over its
expected cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The default paid share: 2% of served forward time (SPEC R4.5 amended, "at most 2%").
DEFAULT_SHARE = 0.02
# The paid bucket holds at most this much: one of the longest shadows (the longest L6 inputs
# run about a second at 1 thread, FACTS.md) must fit in it, or it could never be paid for;
# more would let a burst of paid shadows follow a long stretch of serving
PAID_CAP_S = 1.0


class ShadowBudget:
    """Idle-class shadow time as a leaky bucket (see the module docstring)."""

    def __init__(self, fraction: float, window_s: float, now: float) -> None:
        self.fraction, self.window_s = fraction, window_s
        self.used_s = 0.0  # charged so far
        self._allowed_s, self._at = 0.0, now

    def restart(self, now: float) -> None:
        """Learning begins now: nothing banked before."""
        self._allowed_s, self._at = 0.0, now

    def allowed_s(self, now: float) -> float:
        """Shadow time allowed so far: ``fraction`` of the time since learning began, never
        more than ``fraction * window_s`` ahead of what shadows used."""
        self._allowed_s = min(self._allowed_s + self.fraction * (now - self._at),
                              self.used_s + self.fraction * self.window_s)
        self._at = now
        return self._allowed_s

    def over(self, now: float) -> bool:
        return self.used_s > self.allowed_s(now)

    def charge(self, seconds: float, now: float) -> None:
        self.allowed_s(now)  # banked up to now, before the charge
        self.used_s += max(0.0, seconds)


@dataclass
class PaidShare:
    """The paid learning share (see the module docstring)."""

    share: float = DEFAULT_SHARE
    cap_s: float = PAID_CAP_S
    credit_s: float = 0.0
    served_s: float = 0.0  # served forward time it accrued from
    paid_s: float = 0.0  # CPU time of paid shadows (wall less run delay per thread)
    paid_shadows: int = 0
    per_range: bool = False  # mode 2: each range pays from its own bucket too
    # each size range's own bucket (by its lower bound; none: the range served nothing yet)
    range_credit_s: dict[int, float] = field(default_factory=dict)

    def accrue(self, forward_s: float, lo: int | None = None) -> None:
        """A served forward of ``forward_s`` (of size range ``lo``) ended."""
        self.served_s += forward_s
        self.credit_s = min(self.cap_s, self.credit_s + self.share * forward_s)
        if self.per_range and lo is not None:
            self.range_credit_s[lo] = min(self.cap_s, self.range_credit_s.get(lo, 0.0)
                                          + self.share * forward_s)

    def affords(self, cost_s: float, lo: int | None = None) -> bool:
        """A paid shadow expected to take ``cost_s`` (for size range ``lo``) may start now:
        the bucket holds it, and (``per_range``) the range's own."""
        need = min(cost_s, self.cap_s)
        return self.share > 0 and self.credit_s >= need and (
            not self.per_range or lo is None or self.range_credit_s.get(lo, 0.0) >= need)

    def charge(self, wall_s: float, lo: int | None = None) -> None:
        self.paid_s += wall_s
        self.paid_shadows += 1
        self.credit_s -= wall_s
        if self.per_range and lo is not None:
            self.range_credit_s[lo] = self.range_credit_s.get(lo, 0.0) - wall_s
