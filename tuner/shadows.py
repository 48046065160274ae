"""Where shadow forwards run (R4.5 amended): threads of the tuner's own in ``SCHED_IDLE``.

The loop thread puts itself in ``SCHED_IDLE``; shadow forwards run on an idle thread context
(its lanes are ``SCHED_IDLE`` too) over the backend's twin, so the intra-op pools they use are
made by idle threads and inherit the policy. Nothing here is held while a served forward
needs it: the tuner's lock guards bookkeeping only, and a shadow starts only while no served
forward runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_srun.runtime.backend import Backend
from vllm_srun.runtime.threads import ThreadContext, make_idle
from vllm_srun.runtime.types import ForwardResult, TokenBatch

if TYPE_CHECKING:
    from vllm_srun.tuner.adaptive import AdaptiveThreads, Forward

log = logging.getLogger(__name__)


def idle_shadows(backend: Backend) -> tuple[Forward, Callable[[], None]]:
    """A shadow ``Forward`` on ``SCHED_IDLE`` lanes over the backend's twin (its pools made
    there), and how to shut those lanes down."""
    context = ThreadContext(idle=True)
    twin = backend.twin()

    def forward(batch: TokenBatch, num_threads: int) -> ForwardResult:
        return context.run(num_threads, lambda: twin.forward(batch, num_threads))

    return forward, context.shutdown


class ShadowLoop:
    """The tuner's own thread: ``SCHED_IDLE`` (threads it creates inherit it), it warms every
    count on the shadow lanes, then runs due shadows whenever no served forward runs, and
    writes learnings to the record every ``flush_s``."""

    def __init__(self, tuner: AdaptiveThreads, warm: TokenBatch) -> None:
        self.tuner, self._warm = tuner, warm
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="shadows", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.tuner
        make_idle()
        try:
            for n in t.counts:  # warm every count before it is timed
                t.shadow_forward(self._warm, n)
            while not self._stop:
                if t.step():
                    continue
                if (t._dirty_samples or t._dirty_learned or t._unflushed_comparisons) and \
                        t.clock() - t._last_flush >= t.settings.flush_s:
                    t.flush()
                with t.lock:  # woken when a served forward ends
                    if not self._stop:
                        t.lock.wait(timeout=0.05 if t._jobs else t.settings.flush_s)
        except Exception:
            log.exception("shadow_loop_failed")

    def stop(self) -> None:
        with self.tuner.lock:
            self._stop = True
            self.tuner.lock.notify_all()
        self.thread.join(timeout=60)
