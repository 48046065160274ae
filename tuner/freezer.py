"""Freezing the shadow side beside timed served forwards (R4.5): a served forward that is a
timing sample, or one whose cores a gap-waiting shadow shares, freezes the shadow process
(``SIGSTOP``) while it runs; the last such forward's end thaws it, or holds it frozen a few
ms more (``ShadowGate.thaw_hold_s``) so back-to-back forwards cost one freeze, not one each.
A thread of its own (``Thawer``) thaws a held side once its hold ends. It also keeps how long
the side spent frozen, so a shadow is charged only the time it ran.

Every method is called with the tuner's lock held (``lock``), and never blocks on a shadow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# ``close`` waits this long for the thawer thread: it only waits on the lock's condition
THAWER_JOIN_S = 10.0


class Freezer:
    def __init__(self, pause: Callable[[bool], bool] | None, lock: threading.Condition,
                 clock: Callable[[], float]) -> None:
        # freezes (True) and thaws the shadow side; says whether it is frozen now
        self._pause, self.lock, self.clock = pause, lock, clock
        self.running = 0  # served forwards running with the shadow side frozen
        self.held = False  # ... none now, but it stays frozen until ``_thaw_at``
        self._thaw_at = 0.0
        self._wake = threading.Condition(lock)
        self._thawer: threading.Thread | None = None
        self._stop = False
        self._frozen_s, self._frozen_at = 0.0, None  # frozen so far; since when, if frozen

    @property
    def available(self) -> bool:
        return self._pause is not None

    def pause(self, frozen: bool) -> bool:
        """Freeze or thaw the side, keeping the time it spent frozen."""
        now, is_frozen = self.clock(), self._pause(frozen)
        if is_frozen and self._frozen_at is None:
            self._frozen_at = now
        elif not is_frozen and self._frozen_at is not None:
            self._frozen_s += now - self._frozen_at
            self._frozen_at = None
        return is_frozen

    def frozen_total(self, now: float) -> float:
        """Seconds the shadow side has spent frozen, up to ``now``."""
        return self._frozen_s + (now - self._frozen_at if self._frozen_at is not None else 0.0)

    def served_started(self, want: bool) -> bool:
        """A served forward starts; ``want``: it wants the side frozen. Returns whether it is
        frozen for this forward (a held side stays frozen without a signal either way)."""
        if self.held:
            self.held = False
            frozen = want or self.pause(False)
        else:
            frozen = want and self.pause(True)
        self.running += frozen
        return frozen

    def served_ended(self, hold_s: Callable[[], float]) -> None:
        """A served forward that froze the side ended; the last one thaws it, or holds it
        frozen ``hold_s()`` more where the thawer runs."""
        self.running -= 1
        if self.running:
            return
        hold = hold_s()
        if self._thawer is None or hold <= 0:
            self.pause(False)
            return
        self.held, self._thaw_at = True, self.clock() + hold
        self._wake.notify_all()

    def release(self) -> None:
        """Thaw a side held frozen since the last forward (a paid shadow runs now)."""
        if self.held:
            self.held = False
            self.pause(False)

    def start(self) -> None:
        """Start the thawer thread (not in tests that step shadows by hand)."""
        if self.available and self._thawer is None:
            self._thawer = threading.Thread(target=self._run, name="shadow-thaw", daemon=True)
            self._thawer.start()

    def _run(self) -> None:
        with self.lock:
            while not self._stop:
                if not self.held:
                    self._wake.wait()
                elif (left := self._thaw_at - self.clock()) > 0:
                    self._wake.wait(left)
                else:
                    self.held = False
                    self.pause(False)

    def close(self) -> None:
        """Thaw the side and stop the thawer."""
        with self.lock:
            if self.running or self.held:
                self.running, self.held = 0, False
                self.pause(False)
            self._stop = True
            self._wake.notify_all()
        if self._thawer is not None:
            self._thawer.join(timeout=THAWER_JOIN_S)
            self._thawer = None
