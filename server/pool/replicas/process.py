"""A managed worker process (``python -P -m vllm_srun.server.worker.main``) on a Unix socket,
supervised: a crash is restarted with backoff and counted (R5.9); a worker that a start-up
check refused (the golden check) stays up, out of dispatch, with the check's reason."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx

from vllm_srun.runtime.device import is_gpu
from vllm_srun.server.pool import transport
from vllm_srun.server.pool.backoff import RESTART
from vllm_srun.server.pool.errors import ExchangeError
from vllm_srun.server.pool.outlier import Outcome
from vllm_srun.server.pool.replicas.base import STARTUP_TIMEOUT_S, Replica
from vllm_srun.server.pool.states import ReplicaState
from vllm_srun.server.worker import protocol
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.server.worker.trace import REQUEST_ID_HEADER
from vllm_srun.server.worker.trace import current as current_trace

RESTART_STABLE_S = 60.0  # a worker that ran this long restarts from the first backoff again
# How a managed worker starts. ``-P`` keeps the working directory off the module path (R9.1).
# Only a test-only entry point (tests/faults.py) replaces it, never a flag or variable.
WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-P", "-m", "vllm_srun.server.worker.main")


# How long the front end keeps an idle connection to a worker for reuse (httpx's default).
# The worker keeps one open far longer (``server/worker/main.py``'s ``KEEP_ALIVE_S``), so the
# front end never sends on a connection the worker is closing.
IDLE_EXPIRY_S = 5.0


def _client(socket_path: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                             base_url="http://worker", limits=httpx.Limits(
                                 max_connections=64, max_keepalive_connections=64,
                                 keepalive_expiry=IDLE_EXPIRY_S))


class ProcessReplica(Replica):
    def __init__(self, *args, socket_path: str, spec: WorkerSpec,
                 log_level: str = "warning") -> None:
        super().__init__(*args)
        self.kind = "gpu" if is_gpu(spec.device) else "cpu"
        self.socket_path = socket_path
        self.spec = spec
        self.log_level = log_level
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.client = _client(socket_path)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.id}")

    async def _spawn(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.proc = await asyncio.create_subprocess_exec(
            *WORKER_COMMAND, "--socket", self.socket_path, "--spec", self.spec.to_json(),
            "--replica-id", self.id, "--log-level", self.log_level,
            "--parent-pid", str(os.getpid()), stdin=asyncio.subprocess.DEVNULL)
        self.pid = self.proc.pid

    async def _wait_healthy(self) -> dict | None:
        """Poll /health until the worker is ready (its health body) or says a start-up check
        refused it (``{"check_failed": reason}``); None if it exits or takes too long."""
        end = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < end and self.proc.returncode is None:
            try:
                resp = await self.client.get(protocol.HEALTH, timeout=transport.PROBE_TIMEOUT_S)
                if resp.status_code == 200:
                    return resp.json()
                err = resp.json().get("error", {})
                if err.get("code") == protocol.CHECK_FAILED:
                    return {protocol.CHECK_FAILED: str(err.get("message"))}
            except (httpx.TransportError, ValueError, AttributeError):
                pass
            await asyncio.sleep(0.1)
        return None

    async def _run_once(self) -> int:
        """Start the worker, settle its state, and wait for it to exit; its exit code."""
        self.transition(ReplicaState.STARTING, "starting worker process")
        await self._spawn()
        health = await self._wait_healthy()
        if health is not None and protocol.CHECK_FAILED in health and not self._stopping:
            # deterministic (the golden check): not restarted into the same refusal
            self.transition(ReplicaState.FAILED, health[protocol.CHECK_FAILED])
        elif health is not None and not self._stopping:
            self.precision = health.get("precision")
            self.admit(health.get("limits"), health.get("revision"))
        elif self.proc.returncode is None and not self._stopping:
            self.proc.kill()
        return await self.proc.wait()

    async def _supervise(self) -> None:
        delay = 0.0
        while not self._stopping:
            started = time.monotonic()
            rc = await self._run_once()
            if self._stopping:
                break
            delay = RESTART.next(0.0 if time.monotonic() - started > RESTART_STABLE_S
                                 else delay)
            self.transition(ReplicaState.FAILED, f"worker process exited with code {rc}; "
                                                 f"restarting in {delay:.1f} s")
            await asyncio.sleep(delay)
            self.restarts += 1

    async def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    async def probe(self) -> bool:
        return await transport.healthy(self.client)

    async def call(self, texts, truncate, deadline, field="input", raw=False):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        payload = protocol.Work(list(texts), truncate, remaining_ms, field, raw).encode()
        headers = {"content-type": "application/json"}
        if (trace := current_trace()) is not None:  # the worker logs under the same id
            headers[REQUEST_ID_HEADER] = trace.request_id
        resp = await transport.post(self.id, self.client, protocol.WORK, payload, headers,
                                    deadline)
        if resp.status_code != 200:
            raise transport.exchange_error(self.id, resp, sent_key=False)
        if trace is not None:
            trace.note_headers(resp.headers)
        try:
            return protocol.decode_rows(resp.content, resp.headers)
        except protocol.ProtocolError as exc:
            raise ExchangeError(Outcome.FAILURE, "replica_failed",
                                f"replica {self.id}: {exc}") from None

    async def threads_report(self) -> dict:
        try:
            return (await self.client.get(protocol.THREADS, timeout=5)).json()
        except (httpx.TransportError, ValueError) as exc:
            return {"error": f"replica {self.id} did not report: {exc}"}

    async def metrics_text(self) -> str | None:
        try:
            resp = await self.client.get(protocol.METRICS, timeout=2)
        except httpx.TransportError:
            return None
        return resp.text if resp.status_code == 200 else None
