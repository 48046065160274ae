"""An endpoint the pool does not start: an OpenAI-compatible embeddings server (another
vllm-srun, or any runtime), asked for its own ``model``, with the Bearer key from the variable
its ``api_key_env`` names. It manages its own threads. Limits and revision are checked when it
reports them in ``/v1/models`` (vllm-srun does)."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import orjson

from vllm_srun.server.pool import transport
from vllm_srun.server.pool.backoff import RESTART
from vllm_srun.server.pool.errors import ExchangeError
from vllm_srun.server.pool.outlier import Outcome
from vllm_srun.server.pool.replicas.base import Replica
from vllm_srun.server.pool.states import ReplicaState


class AttachedReplica(Replica):
    kind = "attached"

    def __init__(self, *args, endpoint: str, model: str, api_key: str | None = None) -> None:
        super().__init__(*args)
        self.endpoint, self.model = endpoint, model
        self.protected = api_key is not None
        headers = {"authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self.client = httpx.AsyncClient(base_url=endpoint, headers=headers, limits=httpx.Limits(
            max_connections=64, max_keepalive_connections=64))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._attach(), name=f"attach-{self.id}")

    async def _try_attach(self) -> str | None:
        """One attempt: settle the state and return None, or say why to try again."""
        health = await self.client.get("/health", timeout=transport.PROBE_TIMEOUT_S)
        if health.status_code != 200:
            return f"endpoint /health answered {health.status_code}"
        listing = await self.client.get("/v1/models", timeout=5)
        if listing.status_code in (401, 403):
            self.transition(ReplicaState.UNAUTHORIZED,
                            transport.refused_key(self.protected, listing.status_code))
            return None
        entry = next((m for m in listing.json().get("data", []) if m.get("id") == self.model),
                     None)
        if entry is None:
            self.transition(ReplicaState.INCOMPATIBLE,
                            f"endpoint does not serve model {self.model!r}")
            return None
        limits = {k: entry[k] for k in ("max_num_seqs", "max_num_batched_tokens")
                  if isinstance(entry.get(k), int)}
        self.admit(limits or None, entry.get("revision"))
        return None

    async def _attach(self) -> None:
        delay = 0.0
        while True:
            try:
                if (reason := await self._try_attach()) is None:
                    return
            except (httpx.TransportError, ValueError, AttributeError) as exc:
                reason = f"endpoint cannot be reached: {type(exc).__name__}: {exc}"
            delay = RESTART.next(delay)
            self.transition(ReplicaState.FAILED, f"{reason}; retrying in {delay:.1f} s")
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()

    async def probe(self) -> bool:
        return await transport.healthy(self.client)

    async def call(self, texts, truncate, deadline, field="input", raw=False):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        order = {"model": self.model, "input": texts, "truncate": truncate,
                 "encoding_format": "base64"}
        if raw:  # the vectors before the model's Normalize module
            order["normalize"] = False
        payload = orjson.dumps(order)
        resp = await transport.post(self.id, self.client, "/v1/embeddings", payload,
                                    {"content-type": "application/json",
                                     "x-request-timeout-ms": str(remaining_ms)}, deadline)
        if resp.status_code != 200:
            raise transport.exchange_error(self.id, resp, self.protected)
        try:
            body = resp.json()
            rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                    for d in sorted(body["data"], key=lambda d: d["index"])]
            tokens = int(body.get("usage", {}).get("prompt_tokens", 0))
            return np.stack(rows), tokens
        except (ValueError, KeyError, TypeError) as exc:
            raise ExchangeError(Outcome.FAILURE, "replica_failed",
                                f"replica {self.id} answered malformed JSON: {exc}") from None

    def describe(self) -> dict:
        return {"kind": self.kind, "endpoint": self.endpoint, "model": self.model}
