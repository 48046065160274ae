"""The one-worker shorthand: the worker runs in the front end's process, with the front end's
result cache (R3.4) and no extra hop. It cannot be restarted: if it fails to load, the server
exits."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.server.pool.errors import ExchangeError
from vllm_srun.server.pool.outlier import Outcome
from vllm_srun.server.pool.replicas.base import Replica
from vllm_srun.server.pool.states import ReplicaState
from vllm_srun.server.worker.assembly import Worker
from vllm_srun.server.worker.bridge import run
from vllm_srun.server.worker.metrics import WorkerMetrics

log = logging.getLogger("vllm_srun.pool")

# how an in-process runtime fault ended the exchange (by its R7.2 code)
_CODE_TO_OUTCOME = {"deadline_exceeded": Outcome.TIMEOUT, "not_ready": Outcome.FAILURE,
                    "internal_error": Outcome.FAILURE}


class LocalReplica(Replica):
    kind = "local"

    def __init__(self, *args, worker: Worker,
                 on_load_failure: Callable[[str], None] | None = None) -> None:
        super().__init__(*args)
        self.worker = worker
        self.runner = None
        self.metrics = WorkerMetrics(self.id)
        self._on_load_failure = on_load_failure
        self.pid = os.getpid()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._load(), name=f"load-{self.id}")

    async def _load(self) -> None:
        try:
            runner = await asyncio.to_thread(self.worker.load_to_serve,
                                           self.metrics.record_forward)
        except Exception as exc:
            self.transition(ReplicaState.FAILED, f"load failed: {exc}")
            log.error("model_load_failed replica=%s error=%s", self.id, exc)
            if self._on_load_failure:
                self._on_load_failure(str(exc))
            return
        self.runner = runner
        self.precision = self.worker.precision_report()
        if not runner.ready:
            return self.transition(ReplicaState.FAILED, runner.not_ready_reason or "not ready")
        a = runner.args
        self.admit({"max_num_seqs": a.max_num_seqs,
                    "max_num_batched_tokens": a.max_num_batched_tokens})

    async def stop(self) -> None:
        if self.runner is not None:
            await asyncio.to_thread(self.runner.stop)
            self.worker.unload()

    async def probe(self) -> bool:
        return self.runner is not None and self.runner.ready

    async def call(self, texts, truncate, deadline, field="input", raw=False):
        if deadline <= time.monotonic():  # no exchange: it neither counts nor resets (R5.5)
            raise ExchangeError(Outcome.NOT_SENT, "deadline_exceeded",
                                "deadline passed before the request reached the engine")
        try:
            return await run(self.runner, texts, truncate, deadline, field, raw)
        except RuntimeFault as exc:
            outcome = _CODE_TO_OUTCOME.get(exc.code, Outcome.NEUTRAL)
            raise ExchangeError(outcome, exc.code, str(exc)) from None

    async def threads_report(self) -> dict:
        return self.worker.threads_report(self.runner)

    async def metrics_text(self) -> str | None:
        hits = self.runner.cache.hits if self.runner is not None else 0
        bad = self.runner.engine.non_finite if self.runner is not None else 0
        return self.metrics.render(hits, self.worker.threads_report(self.runner),
                                   non_finite=bad).decode()
