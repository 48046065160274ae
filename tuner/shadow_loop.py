"""The tuner's shadow loop (R4.5 amended): its own thread, at normal priority, that hands
due shadows to the shadow side (``AdaptiveThreads.step``) and keeps the books, holding the
tuner's lock for bookkeeping only; a shadow starts only while no served forward runs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import TokenBatch

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import AdaptiveThreads

log = logging.getLogger(__name__)

# after a shadow forward fails (its process died, hung, or the forward raised), the shadow
# loop waits this long before the next, doubling with each failure in a row up to the most:
# a one-off death (the OOM killer, an operator) costs learning a second; a child that dies
# at every start (a broken install) loads the model at most once a minute (idle class)
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# ``stop`` waits this long for a shadow in flight before the tuner closes the shadow side
# under it (which ends a hung one): the longest shadows run about a second (FACTS.md)
STOP_WAIT_S = 5.0


class ShadowLoop:
    """The tuner's own thread (normal priority: it holds the GIL and the tuner's lock only for
    bookkeeping): it warms every count on the shadow side, then runs due shadows whenever no
    served forward runs, and writes learnings to the record every ``flush_s``. A shadow
    forward that fails (``RuntimeFault``) is counted (``shadow_faults``) and retried after a
    backoff (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``); a ``ShadowProcess`` starts a new
    child for it. Any other error stops learning; serving goes on, and the report says why."""

    def __init__(self, tuner: AdaptiveThreads, warm: TokenBatch) -> None:
        self.tuner, self._warm = tuner, warm
        self._stop = False
        self._retry_s = 0.0  # the backoff after the last failure in a row; 0 after a success
        self.thread = threading.Thread(target=self._run, name="shadows", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.tuner
        while not self._stop:
            try:
                self._learn()
            except RuntimeFault as exc:
                if self._stop:  # the tuner closed the shadow side under a shadow in flight
                    return
                self._failed(exc)
            except Exception as exc:  # learning stops; serving goes on, the report says why
                t.side.error = f"shadow forwards stopped: {exc}"
                log.exception("shadow_loop_failed")
                return

    def _learn(self) -> None:
        t = self.tuner
        if not t.side.warm:
            t.warm_shadows(self._warm)
        while not self._stop:
            if t.step():
                self._retry_s = 0.0
                continue
            if t.flush_due():
                t.flush()
            if t.side.verifier.step():  # nothing else due: verify a shape (mode 2)
                self._retry_s = 0.0
                continue
            with t.lock:  # woken when a served forward ends, or a shadow may start
                if not self._stop:
                    wait_s = 0.05 if t.learner.board.jobs or t.side.verifier.pending() else \
                        t.settings.flush_s
                    if t.gate.sharing_at > (now := t.clock()):
                        wait_s = min(wait_s, t.gate.sharing_at - now)
                    t.lock.wait(timeout=wait_s)

    def _failed(self, exc: RuntimeFault) -> None:
        """A shadow forward failed: count it, say so, and wait out the backoff."""
        t = self.tuner
        self._retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * self._retry_s))
        with t.lock:
            t.side.faults += 1
            t.side.error = (f"shadow forwards failed {t.side.faults} time(s), retried "
                              f"after a backoff; the last: {exc}")
            log.warning("shadow_forward_failed faults=%d retry_s=%.0f error=%s",
                        t.side.faults, self._retry_s, exc)
            end = time.monotonic() + self._retry_s
            while not self._stop and (left := end - time.monotonic()) > 0:
                t.lock.wait(timeout=left)

    def stop(self, wait_s: float = 60.0) -> bool:
        """Ask the loop to end; wait up to ``wait_s`` for it. Returns whether it ended."""
        with self.tuner.lock:
            self._stop = True
            self.tuner.lock.notify_all()
        self.thread.join(timeout=wait_s)
        return not self.thread.is_alive()
