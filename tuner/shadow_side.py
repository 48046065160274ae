"""The shadow side as one worker's tuner holds it (R4.5 amended): the forwards that run
shadows (idle class, or at normal priority where the learning share pays), the freezer that
stops them beside timed served forwards, what they may spend and spent (the idle-class
budget, the paid share, wall time), their faults, the loop that runs them
(``shadow_loop.ShadowLoop``) and mode 2's idle verification (``idle_verify.IdleVerifier``).

Mechanism only: what runs when is ``AdaptiveThreads.step`` and ``scheduling.ShadowGate``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.freezer import Freezer
from vllm_srun.tuner.inflight import ShadowStart
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.shadow_loop import STOP_WAIT_S, ShadowLoop
from vllm_srun.tuner.share import PaidShare, ShadowBudget

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import Forward
    from vllm_srun.tuner.idle_verify import IdleVerifier

log = logging.getLogger(__name__)


class ShadowSide:
    def __init__(self, settings: TunerSettings, lock: threading.Condition,
                 clock: Callable[[], float], forward: Forward, paid_forward: Forward,
                 pause: Callable[[bool], bool] | None, verifier: IdleVerifier,
                 on_close: Callable[[], None] | None = None, per_range: bool = False) -> None:
        self.forward = forward  # a shadow in the idle class
        self.paid_forward = paid_forward  # ... one the learning share pays for
        self.on_close = on_close  # closes the shadow side (a ShadowProcess)
        self.freezer = Freezer(pause, lock, clock)
        # idle-class shadow time charged to ``budget_fraction``: a shadow's wall time less
        # what it spent frozen (``Freezer.frozen_total``: SIGSTOP) or waiting for CPUs (its
        # threads' run delay, per thread): a shadow frozen through a burst of load took no
        # CPU, and charged its wall time, one held frozen through 16-connection bursts spent
        # the budget for minutes (mode 2: 0-1 window passes per range in 2 minutes, 0.68x
        # fixed 2 at 16 connections)
        spend = settings.spending
        self.budget = ShadowBudget(spend.budget_fraction, spend.budget_window_s, clock())
        # the paid learning share (mode 2: each range also from its own served time)
        self.paid = PaidShare(spend.learning_share, per_range=per_range)
        self.wall_s = 0.0  # ... and what shadows took in wall time
        self.faults = 0  # shadow forwards that failed (a ShadowProcess restarts)
        self.error: str | None = None  # why, the last time
        self.warm = False  # the shadow loop has run every count once
        self.loop: ShadowLoop | None = None
        self.verifier = verifier  # mode 2: shapes verified in idle time

    def run(self, batch: TokenBatch, count: int, paid: bool) -> ForwardResult:
        """One shadow forward; ``paid``: at normal priority (``paid_forward``)."""
        return (self.paid_forward if paid else self.forward)(batch, count)

    def charge(self, start: ShadowStart, result: ForwardResult, now: float) -> None:
        """A due shadow ended: its wall time, and what it took of the paid share (its wall
        time less its threads' run delay per thread) or of the idle-class budget (less the
        time it spent frozen, too)."""
        wall = now - start.began_s
        self.wall_s += wall
        waited = (result.waited_s or 0.0) / max(1, start.count)
        if start.paid:
            self.paid.charge(max(0.0, wall - waited), start.lo)
        else:
            frozen = self.freezer.frozen_total(now) - start.frozen_s
            self.budget.charge(wall - frozen - waited, now)

    def close(self, flush: Callable[[], None]) -> None:
        """Stop the loop, ``flush``, close the shadow side (the freezer is closed first)."""
        loop, self.loop = self.loop, None
        if loop is not None and not loop.stop(STOP_WAIT_S):
            # a shadow in flight did not end (a hung child): closing the shadow side ends it
            log.warning("shadow_loop_stuck wait_s=%.0f action=close_shadow_side", STOP_WAIT_S)
        flush()
        if self.on_close is not None:
            self.on_close()
        if loop is not None:
            loop.stop(STOP_WAIT_S)
