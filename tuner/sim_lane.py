"""A simulated worker's shadow loop (``tuner/sim_host.py``): the tuner's ``step`` on a thread of
its own, run in lockstep with the event loop, so a shadow forward lasts virtual time.

Invariant: the lane's thread runs only between ``_handoff``'s release and its acquire, while
the event loop waits; so one thread runs at a time and runs are deterministic.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.adaptive import AdaptiveThreads
from vllm_srun.tuner.sim_types import InFlight, answer

if TYPE_CHECKING:
    from vllm_srun.tuner.sim_host import SimulatedHost


class Stop(BaseException):
    """The run is over: a shadow in flight ends without a result."""


class ShadowLane:
    """A worker's shadow loop on its own thread, run in lockstep with the event loop."""

    def __init__(self, host: SimulatedHost, worker: int, tuner: AdaptiveThreads) -> None:
        self.host, self.worker, self.tuner = host, worker, tuner
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self.in_flight: InFlight | None = None
        self.frozen = False
        self.error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"sim-{worker}")
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                self._back.release()
                return
            try:
                while self.tuner.step():
                    pass
            except Stop:
                self._back.release()
                return
            except BaseException as exc:  # surfaced in the event loop
                self.error = exc
            self._back.release()

    def _handoff(self) -> None:
        self._go.release()
        self._back.acquire()
        if self.error is not None:
            raise self.error

    def resume(self) -> None:
        """The shadow in flight reached its end on the virtual clock: it returns, and the
        loop goes on until the next is in flight or none may start."""
        self._handoff()

    def wake(self) -> None:
        """Let the loop run due shadows until one is in flight or none may start."""
        if self.in_flight is None:
            self._handoff()

    def shadow_forward(self, batch: TokenBatch, n: int) -> ForwardResult:
        """Called on the lane's thread by the tuner: waits for the virtual clock."""
        fwd = self.host.clock.start_forward(self.worker, batch, n, shadow=True)
        self.in_flight = fwd
        self._back.release()
        self._go.acquire()
        self.in_flight = None
        if self._stop:
            raise Stop
        wall_s = self.host.clock.now_s - fwd.start_s
        return ForwardResult(answer(batch), n, n, wall_s, fwd.waited_s)

    def pause(self, frozen: bool) -> bool:
        self.frozen = frozen
        return frozen

    def stop(self) -> None:
        self._stop = True
        self._go.release()
        self._back.acquire()
        self._thread.join(timeout=5)


