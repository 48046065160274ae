"""The three kinds of replica behind one dispatch (R5.1): an in-process worker (the one-worker
shorthand), a managed worker process (CPU or GPU) on a Unix socket, and an attached endpoint.

Each replica answers :meth:`Replica.call` with ``(rows, prompt_tokens)`` or raises
:class:`ExchangeError`, which says how the exchange ended (:class:`Outcome`) so the pool can
count timeouts and back off, and carries the R7.2 status for the caller.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import orjson

from vllm_srun.runtime.device import is_gpu
from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.types import TextInput
from vllm_srun.server.bridge import fault_status, run
from vllm_srun.server.outlier import Outcome

log = logging.getLogger("vllm_srun.pool")

GRACE_S = 0.05            # beyond the deadline before the pool gives up on the worker itself
PROBE_TIMEOUT_S = 1.0
STARTUP_TIMEOUT_S = 600.0
RESTART_START_S, RESTART_MAX_S, RESTART_STABLE_S = 0.5, 30.0, 60.0
# How a managed worker starts. ``-P`` keeps the working directory off the module path (R9.1).
# Only a test-only entry point (tests/fault_server.py) replaces it, never a flag or variable.
WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-P", "-m", "vllm_srun.server.worker")


class ExchangeError(Exception):
    def __init__(self, outcome: Outcome, status: int, code: str, message: str,
                 retry_elsewhere: bool = False) -> None:
        super().__init__(message)
        self.outcome, self.status, self.code, self.message = outcome, status, code, message
        self.retry_elsewhere = retry_elsewhere  # nothing was done: another replica may try


@dataclass
class LoadAccount:
    """The load estimate of one physical worker, shared by everything dispatched to it."""

    key: str
    in_flight: int = 0
    outstanding_bytes: int = 0
    last_assigned: int = 0


class Replica(abc.ABC):
    """One replica behind the pool's dispatch; the kinds below implement the exchange."""

    kind = "replica"

    def __init__(self, replica_id: str, placement: str, account: LoadAccount,
                 expected_limits: dict[str, int],
                 on_transition: Callable[[Replica, str, str], None]) -> None:
        self.id = replica_id
        self.placement = placement          # device (cpu, cuda:0) or endpoint URL
        self.account = account
        self.expected_limits = expected_limits  # the limits the deployment sets (R5.4)
        self.state = "starting"
        self.reason: str | None = "starting"
        self.restarts = 0
        self.limits: dict[str, int] | None = None
        self.pid: int | None = None
        self._on_transition = on_transition
        self._ready_event = asyncio.Event()

    def transition(self, state: str, reason: str | None) -> None:
        if state == self.state and reason == self.reason:
            return
        self.state, self.reason = state, reason
        if state in ("ready", "incompatible", "failed"):
            self._ready_event.set()
        self._on_transition(self, state, reason or "")

    def _check_limits(self, limits: dict[str, int] | None) -> None:
        """Ready, or incompatible when the worker reports limits other than those set."""
        self.limits = limits
        if limits is not None:
            wrong = [f"{k}={limits.get(k)} (set {v})" for k, v in self.expected_limits.items()
                     if limits.get(k) != v]
            if wrong:
                return self.transition("incompatible", "reports " + ", ".join(wrong))
        self.transition("ready", None)

    async def settled(self, timeout_s: float) -> bool:
        """Wait until the replica is ready, incompatible or failed; True when ready."""
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout_s)
        except TimeoutError:
            return False
        return self.state == "ready"

    @abc.abstractmethod
    async def start(self) -> None:
        """Begin loading or attaching; returns at once (``settled`` waits)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the worker (or detach) and release its resources."""

    @abc.abstractmethod
    async def probe(self) -> bool:
        """One health probe: True when the replica says it is ready."""

    @abc.abstractmethod
    async def call(self, texts: list[TextInput], truncate: bool, deadline: float,
                   field: str = "input") -> tuple[np.ndarray, int]:
        """One exchange: (rows, prompt tokens), or ExchangeError saying how it ended.
        ``texts`` may hold text pairs (reranking); ``field`` names them in errors."""

    async def threads_report(self) -> dict:
        return {"notes": [f"{self.kind} replicas manage their own threads"]}

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid}


class LocalReplica(Replica):
    """The one-worker shorthand: the engine runs in the front end's process, with the front
    end's result cache (R3.4) and no extra hop. It cannot be restarted: if it fails to load,
    the server exits."""

    kind = "local"

    def __init__(self, *args, deployment, on_forward=None, on_load_failure=None) -> None:
        super().__init__(*args)
        self.deployment = deployment
        self.runner = None
        self._on_forward = on_forward
        self._on_load_failure = on_load_failure
        self.pid = os.getpid()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._load(), name=f"load-{self.id}")

    async def _load(self) -> None:
        try:
            runner = await asyncio.to_thread(self.deployment.load, self._on_forward)
        except Exception as exc:
            self.transition("failed", f"load failed: {exc}")
            log.error("model_load_failed replica=%s error=%s", self.id, exc)
            if self._on_load_failure:
                self._on_load_failure(str(exc))
            return
        self.runner = runner
        if not runner.ready:
            return self.transition("failed", runner.not_ready_reason or "not ready")
        a = runner.args
        self._check_limits({"max_num_seqs": a.max_num_seqs,
                            "max_num_batched_tokens": a.max_num_batched_tokens})

    async def stop(self) -> None:
        if self.runner is not None:
            await asyncio.to_thread(self.runner.stop)

    async def probe(self) -> bool:
        return self.runner is not None and self.runner.ready

    async def call(self, texts, truncate, deadline, field="input"):
        if deadline <= time.monotonic():  # no exchange: it neither counts nor resets (R5.5)
            raise ExchangeError(Outcome.NOT_SENT, 504, "deadline_exceeded",
                                "deadline passed before the request reached the engine")
        try:
            return await run(self.runner, texts, truncate, deadline, field)
        except RuntimeFault as exc:
            status, code = fault_status(exc)
            outcome = {504: Outcome.TIMEOUT, 503: Outcome.FAILURE,
                       500: Outcome.FAILURE}.get(status, Outcome.NEUTRAL)
            raise ExchangeError(outcome, status, code, str(exc)) from None

    async def threads_report(self) -> dict:
        return self.deployment.threads_report(self.runner)


def _decode_rows(resp: httpx.Response) -> tuple[np.ndarray, int]:
    rows, dim = int(resp.headers["x-rows"]), int(resp.headers["x-dim"])
    shape = (rows, int(resp.headers["x-len"]), dim) if "x-len" in resp.headers else (rows, dim)
    out = np.frombuffer(resp.content, dtype="<f4").reshape(shape)
    return out, int(resp.headers["x-tokens"])


def _worker_error(replica: Replica, resp: httpx.Response) -> ExchangeError:
    try:
        err = resp.json()["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "replica_error", resp.text[:200]
    status = resp.status_code
    if status == 504:
        return ExchangeError(Outcome.TIMEOUT, 504, "deadline_exceeded",
                             f"replica {replica.id}: {message}")
    if status in (429, 503):
        return ExchangeError(Outcome.REFUSED, 503, "not_ready",
                             f"replica {replica.id} refused: {message}", retry_elsewhere=True)
    if 400 <= status < 500:
        return ExchangeError(Outcome.NEUTRAL, status, code, message)
    return ExchangeError(Outcome.FAILURE, 503, "replica_failed",
                         f"replica {replica.id} failed: {message}")


async def _send(replica: Replica, client: httpx.AsyncClient, path: str, payload: bytes,
                headers: dict[str, str], deadline: float) -> httpx.Response:
    """POST with the deadline as the limit; classify transport faults."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:  # no exchange: it neither counts nor resets (R5.5)
        raise ExchangeError(Outcome.NOT_SENT, 504, "deadline_exceeded",
                            "deadline passed before the request was sent")
    try:
        return await client.post(path, content=payload, headers=headers,
                                 timeout=httpx.Timeout(remaining + GRACE_S,
                                                       connect=min(remaining, 1.0)))
    except httpx.ConnectError as exc:
        raise ExchangeError(Outcome.FAILURE, 503, "replica_unavailable",
                            f"replica {replica.id} cannot be reached: {exc}",
                            retry_elsewhere=True) from None
    except httpx.TimeoutException:
        raise ExchangeError(Outcome.TIMEOUT, 504, "deadline_exceeded",
                            f"replica {replica.id} did not answer within the deadline") from None
    except httpx.TransportError as exc:
        raise ExchangeError(Outcome.FAILURE, 503, "replica_failed",
                            f"replica {replica.id} failed while answering: "
                            f"{type(exc).__name__}: {exc}") from None


class HttpReplica(Replica):
    """A replica reached over HTTP (``self.client``): probed with ``GET /health``."""

    client: httpx.AsyncClient

    async def probe(self) -> bool:
        try:
            return (await self.client.get("/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
        except httpx.TransportError:
            return False


class ProcessReplica(HttpReplica):
    """A managed worker process (``python -P -m vllm_srun.server.worker``) on a Unix socket,
    supervised: a crash is restarted with backoff and counted (R5.9)."""

    def __init__(self, *args, socket_path: str, spec: dict, log_level: str = "warning") -> None:
        super().__init__(*args)
        self.kind = "gpu" if is_gpu(spec["device"]) else "cpu"
        self.socket_path = socket_path
        self.spec = spec
        self.log_level = log_level
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path),
            base_url="http://worker", limits=httpx.Limits(max_connections=64,
                                                          max_keepalive_connections=64))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.id}")

    async def _spawn(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.proc = await asyncio.create_subprocess_exec(
            *WORKER_COMMAND, "--socket", self.socket_path,
            "--spec", json.dumps(self.spec), "--replica-id", self.id,
            "--log-level", self.log_level, "--parent-pid", str(os.getpid()),
            stdin=asyncio.subprocess.DEVNULL)
        self.pid = self.proc.pid

    async def _wait_healthy(self) -> dict | None:
        """Poll /health until the worker is ready; None if it exits or takes too long."""
        end = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < end and self.proc.returncode is None:
            try:
                resp = await self.client.get("/health", timeout=PROBE_TIMEOUT_S)
                if resp.status_code == 200:
                    return resp.json()
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        return None

    async def _supervise(self) -> None:
        delay = RESTART_START_S
        while not self._stopping:
            self.transition("starting", "starting worker process")
            await self._spawn()
            started = time.monotonic()
            health = await self._wait_healthy()
            if health is not None and not self._stopping:
                self._check_limits(health.get("limits"))
            elif self.proc.returncode is None and not self._stopping:
                self.proc.kill()
            rc = await self.proc.wait()
            if self._stopping:
                break
            if time.monotonic() - started > RESTART_STABLE_S:
                delay = RESTART_START_S
            self.transition("failed", f"worker process exited with code {rc}; "
                                      f"restarting in {delay:.1f} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)
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

    async def call(self, texts, truncate, deadline, field="input"):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        payload = orjson.dumps({"texts": texts, "truncate": truncate,
                                "timeout_ms": remaining_ms, "field": field})
        resp = await _send(self, self.client, "/work", payload,
                           {"content-type": "application/json"}, deadline)
        if resp.status_code != 200:
            raise _worker_error(self, resp)
        return _decode_rows(resp)

    async def threads_report(self) -> dict:
        try:
            return (await self.client.get("/threads", timeout=5)).json()
        except (httpx.TransportError, ValueError) as exc:
            return {"error": f"replica {self.id} did not report: {exc}"}


class AttachedReplica(HttpReplica):
    """An endpoint the pool does not start: an OpenAI-compatible embeddings server (another
    vllm-srun, or any runtime), asked for its own ``model``. It manages its own threads.
    Limits are checked when it reports them in ``/v1/models`` (vllm-srun does)."""

    kind = "attached"

    def __init__(self, *args, endpoint: str, model: str) -> None:
        super().__init__(*args)
        self.endpoint, self.model = endpoint, model
        self.client = httpx.AsyncClient(base_url=endpoint, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=64))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._attach(), name=f"attach-{self.id}")

    async def _attach(self) -> None:
        delay = RESTART_START_S
        while True:
            try:
                health = await self.client.get("/health", timeout=PROBE_TIMEOUT_S)
                if health.status_code == 200:
                    models = (await self.client.get("/v1/models", timeout=5)).json()
                    entry = next((m for m in models.get("data", [])
                                  if m.get("id") == self.model), None)
                    if entry is None:
                        self.transition("incompatible", f"endpoint does not serve model "
                                                        f"{self.model!r}")
                        return
                    limits = {k: entry[k] for k in ("max_num_seqs", "max_num_batched_tokens")
                              if isinstance(entry.get(k), int)}
                    self._check_limits(limits or None)
                    return
                reason = f"endpoint /health answered {health.status_code}"
            except (httpx.TransportError, ValueError, AttributeError) as exc:
                reason = f"endpoint cannot be reached: {type(exc).__name__}: {exc}"
            self.transition("failed", f"{reason}; retrying in {delay:.1f} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()

    async def call(self, texts, truncate, deadline, field="input"):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        payload = orjson.dumps({"model": self.model, "input": texts, "truncate": truncate,
                                "encoding_format": "base64"})
        resp = await _send(self, self.client, "/v1/embeddings", payload,
                           {"content-type": "application/json",
                            "x-request-timeout-ms": str(remaining_ms)}, deadline)
        if resp.status_code != 200:
            raise _worker_error(self, resp)
        try:
            body = resp.json()
            rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                    for d in sorted(body["data"], key=lambda d: d["index"])]
            tokens = int(body.get("usage", {}).get("prompt_tokens", 0))
            return np.stack(rows), tokens
        except (ValueError, KeyError, TypeError) as exc:
            raise ExchangeError(Outcome.FAILURE, 503, "replica_failed",
                                f"replica {self.id} answered malformed JSON: {exc}") from None

    def describe(self) -> dict:
        return {"kind": self.kind, "endpoint": self.endpoint, "model": self.model}
