"""The exactness ledger (R4.3, R4.6-R4.8, R4.13): everything that decides whether an answer
may be served at a count other than the configured one, in one place.

It holds the golden check's outcome (``locked_reason``), the host record's voucher, drift
and retirement, and per range the agreements each count has made with served answers (its
transition window). ``may_serve`` is the only gate: ``AdaptiveThreads.served_threads`` asks
it and nothing else about exactness, and the report reads the same state.

Invariant: ``may_serve(lo, n, rows, length)`` is true for ``n`` other than the configured
count only while the golden check has passed, no worker of the scope has seen a drift, the
worker serves (mode 2), the voucher covers ``n`` and the configured count for that shape
(rows x padded length), and ``n`` has agreed bit for bit with the configured count on
``window`` served batches of the range (its transition window) — or, for vouched exploration
(``explore``), without the window: the voucher alone says the answer is the same, and an
audit at the configured count checks it afterwards.

An agreement: one served answer and one shadow of the same batch at another count, equal in
every bit. It counts toward count ``k``'s window when the other side is the configured count
or a count whose window passed (bit-identity is transitive). Any difference retires learning
for the scope for good (R4.7), so agreements never need to be consecutive to be a streak;
they are kept across relearning (a count verified once serves at once when relearnt).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np

from vllm_srun.records.host_record import DriftEvent, Voucher
from vllm_srun.tuner.modes import AdaptiveMode


class Refusal(enum.StrEnum):
    """Why a count may not serve a forward (the configured count always may)."""

    LOCKED = "golden check has not passed"
    RETIRED = "retired by drift"
    LEARN_ONLY = "mode 1 serves the configured count"
    UNCOVERED = "the voucher does not cover this count and shape"
    WINDOW = "in its transition window"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    refusal: Refusal | None = None


ALLOWED = Verdict(True)
_REFUSED = {reason: Verdict(False, reason) for reason in Refusal}


def output_bits(outputs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(outputs, dtype=np.float32).view(np.uint32)


class ExactnessLedger:
    def __init__(self, mode: AdaptiveMode, configured: int, window: int) -> None:
        self.mode, self.configured, self.window = mode, configured, window
        self.locked_reason: str | None = "golden check has not run"
        self.voucher = Voucher(0, 0, False)
        self.retired: DriftEvent | None = None
        self.retired_at: float | None = None  # time.time() this worker stopped learning
        self._agreed: dict[int, dict[int, int]] = {}  # range -> count -> agreements
        self.comparisons = 0  # shadows that agreed with the served answer
        self.audits = 0  # ... of forwards served at a count other than the configured

    # -- the gate ------------------------------------------------------------------------
    def may_serve(self, lo: int, count: int, rows: int, length: int,
                  explore: bool = False) -> Verdict:
        """Whether a forward of range ``lo`` and shape ``rows`` x ``length`` (padded) may be
        served at ``count`` (see the module docstring); ``explore``: vouched exploration,
        which needs no transition window."""
        if count == self.configured:
            return ALLOWED
        if (refusal := self._host_refusal()) is not None:
            return _REFUSED[refusal]
        if not self.voucher.covers(rows, length, count, self.configured):
            return _REFUSED[Refusal.UNCOVERED]
        if not explore and not self.window_passed(lo, count):
            return _REFUSED[Refusal.WINDOW]
        return ALLOWED

    def may_serve_range(self, lo: int, count: int) -> bool:
        """``may_serve`` for some shape: the voucher covers ``count`` at all (the range's
        state; each forward's shape is checked by ``may_serve``)."""
        return count == self.configured or (
            self._host_refusal() is None and self.vouches_for(count)
            and self.window_passed(lo, count))

    def _host_refusal(self) -> Refusal | None:
        if self.locked_reason is not None:
            return Refusal.LOCKED
        if self.retired is not None:
            return Refusal.RETIRED
        if self.mode is not AdaptiveMode.SERVE:
            return Refusal.LEARN_ONLY
        return None

    def vouches_for(self, count: int) -> bool:
        """The voucher covers ``count`` beside the configured count (for some shapes)."""
        return self.voucher.covers_counts(count, self.configured)

    @property
    def learning(self) -> bool:
        """Exploration and shadows may run: the golden check passed, no drift retired it."""
        return self.locked_reason is None and self.retired is None

    # -- the transition window -----------------------------------------------------------
    def progress(self, lo: int, count: int) -> int:
        """Agreements ``count`` has made with served answers in range ``lo``."""
        return self._agreed.get(lo, {}).get(count, 0)

    def window_passed(self, lo: int, count: int) -> bool:
        return count == self.configured or self.progress(lo, count) >= self.window

    def window_due(self, lo: int, learned: int | None) -> bool:
        """Mode 2: range ``lo``'s learned count still needs comparisons to serve."""
        return (self.mode is AdaptiveMode.SERVE and learned is not None
                and not self.window_passed(lo, learned) and self.vouches_for(learned))

    def toward_window(self, lo: int, served: int, shadow: int, learned: int | None) -> bool:
        """A shadow at ``shadow`` of a batch served at ``served`` would count toward a
        window still open (mode 2, vouched): one side is the configured count, and while the
        range explores, the served side is not (an audit of what exploring served)."""
        if self.mode is not AdaptiveMode.SERVE or not self.voucher.vouches:
            return False
        if (served == self.configured) == (shadow == self.configured):
            return False
        if learned is None and served == self.configured:
            return False
        other = shadow if served == self.configured else served
        return not self.window_passed(lo, other)

    # -- comparisons and drift -----------------------------------------------------------
    def agree(self, lo: int, served: int, shadow: int) -> None:
        """A shadow at ``shadow`` reproduced an answer served at ``served`` bit for bit."""
        self.comparisons += 1
        self.audits += served != self.configured
        if served == shadow:
            return
        agreed = self._agreed.setdefault(lo, {})
        for k, other in ((served, shadow), (shadow, served)):
            if k != self.configured and self.window_passed(lo, other):
                agreed[k] = agreed.get(k, 0) + 1

    def retire(self, event: DriftEvent) -> None:
        """Learning ends for good (R4.7): nothing but the configured count serves."""
        self.retired, self.retired_at = event, time.time()


def first_difference(served: np.ndarray, shadow: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first bit-level difference of two answers, or None if identical."""
    a, b = output_bits(served), output_bits(shadow)
    if a.shape == b.shape and np.array_equal(a, b):
        return None
    if a.shape != b.shape:
        return (0,) * max(1, a.ndim)
    return tuple(int(i) for i in np.argwhere(a != b)[0])
