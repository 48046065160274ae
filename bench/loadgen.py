"""The one load generator every server is measured with: closed-loop clients over HTTP."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np


@dataclass(frozen=True)
class LoadResult:
    clients: int
    requests: int
    errors: int
    wall_s: float
    latencies_ms: tuple[float, ...]
    samples: tuple[tuple[int, float], ...] = ()  # (payload index, ms) of answered requests

    @property
    def throughput_rps(self) -> float:
        return (self.requests - self.errors) / self.wall_s if self.wall_s else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


async def _run(url: str, payloads: list[dict], clients: int, duration_s: float,
               model: str | None, think_s: float = 0.0) -> LoadResult:
    latencies: list[float] = []
    samples: list[tuple[int, float]] = []
    errors = 0
    next_i = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        end = time.perf_counter() + duration_s

        async def one_client() -> None:
            nonlocal next_i, errors
            while time.perf_counter() < end:
                index = next_i % len(payloads)
                body = dict(payloads[index])
                next_i += 1
                if model:
                    body["model"] = model
                start = time.perf_counter()
                try:
                    r = await client.post("/v1/embeddings", json=body)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                ms = (time.perf_counter() - start) * 1000
                latencies.append(ms)
                if ok:
                    samples.append((index, ms))
                errors += 0 if ok else 1
                if think_s:
                    await asyncio.sleep(think_s)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return LoadResult(clients, len(latencies), errors, wall, tuple(latencies), tuple(samples))


def run_load(url: str, texts: list[str], clients: int, duration_s: float,
             model: str | None = None, think_s: float = 0.0,
             extra: dict | None = None) -> LoadResult:
    """``clients`` concurrent clients, each sending one text per request (and pausing
    ``think_s`` after each answer), for ``duration_s``; ``extra`` joins every body."""
    payloads = [{"input": t, **(extra or {})} for t in texts]
    return asyncio.run(_run(url, payloads, clients, duration_s, model, think_s))


class Refused(RuntimeError):
    """The server answers, but its quality gate refused the precision it was asked for."""


def wait_healthy(url: str, timeout_s: float = 300, path: str = "/health") -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            answer = httpx.get(url + path, timeout=2)
            if answer.status_code == 200:
                return
            if "quality gate" in answer.text:  # a refused precision never becomes ready
                raise Refused(f"{url}: {answer.text}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")
