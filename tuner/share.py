"""What learning may spend (R4.5 amended): idle CPU, and a bounded paid share of serving.

``ShadowBudget``: shadows in the idle class take at most ``fraction`` of wall time, charged
by the CPU they took (wall time less time frozen or waiting for CPUs), as a leaky bucket that
banks idle time for ``window_s`` at most (an idle hour let half an hour of shadows run at
once when it banked without a cap).

``PaidShare``: where traffic leaves no idle CPU, a due shadow that has starved (see
``scheduling.ShadowGate.starved``) may run at normal priority beside served forwards: it
takes CPU from them, so it is paid from a bucket that fills at ``share`` of served forward
time (default 2%), holds at most ``cap_s``, and is charged the CPU the paid shadow took:
its wall time less its threads' run delay per thread (a thread waiting for a CPU takes none
from served forwards; on a host that other tasks load, charged its wall time, a 2-thread
paid shadow of 25 ms ran 0.5 s and spent a minute's share). A paid shadow starts only while
the bucket holds its expected cost. Invariant: paid seconds never exceed ``share`` of the
served forward seconds so far plus ``cap_s`` plus what the last paid shadow ran over its
expected cost.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def accrue(self, forward_s: float) -> None:
        """A served forward of ``forward_s`` ended."""
        self.served_s += forward_s
        self.credit_s = min(self.cap_s, self.credit_s + self.share * forward_s)

    def affords(self, cost_s: float) -> bool:
        """A paid shadow expected to take ``cost_s`` may start now."""
        return self.share > 0 and self.credit_s >= min(cost_s, self.cap_s)

    def charge(self, wall_s: float) -> None:
        self.paid_s += wall_s
        self.paid_shadows += 1
        self.credit_s -= wall_s
