"""The shadow process's own side (``shadows.ShadowProcess`` starts it): the loop that serves
shadow forwards in ``SCHED_IDLE`` over its own backend, timing each forward's own threads'
waits (``run_delay``), and a process's CPU ticks (a child that uses none while not frozen is
hung).

It imports no more of the tuner than ``run_delay``: the spawned child loads only this module,
that one and the runtime.
"""

from __future__ import annotations

import logging
import signal

from vllm_srun.runtime.backend import Backend, load_backend
from vllm_srun.runtime.lifetime import die_with_parent
from vllm_srun.runtime.threads import ThreadContext, make_process_idle, set_process_idle
from vllm_srun.runtime.types import ForwardResult, Manifest, TokenBatch
from vllm_srun.tuner.run_delay import RunDelay, forward_wait_s

log = logging.getLogger(__name__)


def cpu_ticks(pid: int) -> int | None:
    """CPU time of a process, all its threads, in clock ticks; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def serve_shadows(conn, manifest: Manifest, backend_name: str, parent: int, armed,
                  loaded, precision: str = "float32") -> None:
    die_with_parent(parent, signal.SIGKILL)  # SIGKILL: even while frozen
    armed.set()  # only now may the worker freeze it
    make_process_idle()  # every thread made from here on inherits it
    backend = load_backend(manifest, backend_name, precision=precision, several_counts=True)
    loaded.set()
    context = ThreadContext()
    waits = RunDelay()  # the forward's own threads' waits (``run_delay``)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        ids, mask, types, raw, n, paid = msg  # the served batch as it ran (pairs, raw rows)
        batch = TokenBatch(ids, mask, types, raw)
        try:
            if paid and not set_process_idle(False):  # normal priority for this job only
                log.warning("paid_shadow_priority_unavailable action=run_idle")
            try:
                r, waited = context.run(n, lambda b=batch, k=n: _waited(waits, backend, b, k))
            finally:
                if paid:
                    set_process_idle(True)
            conn.send((True, (r.outputs, r.num_threads, r.observed_threads, r.forward_s,
                              waited)))
        except Exception as exc:  # reported to the tuner, which logs it
            conn.send((False, repr(exc)))


def _waited(waits: RunDelay, backend: Backend, batch: TokenBatch, n: int
            ) -> tuple[ForwardResult, float | None]:
    """A forward on its lane, with its threads' waits over just its own time (a lane that
    waited to be woken is not the count's cost either)."""
    before = waits.snapshot()
    r = backend.forward(batch, n)
    return r, forward_wait_s(before, waits.snapshot(), n, r.forward_s)
