"""A bare HTTP/1.1 keep-alive client on asyncio streams, for bursts and soaks.

httpx's connection pool costs more client CPU than the server under test does once a few
hundred connections are open; this client writes a request and reads one response per
round trip, nothing else.
"""

from __future__ import annotations

import asyncio
import time


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Conn:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def post(self, path: str, body: bytes,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
        status = int((await self.reader.readline()).split()[1])
        head: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            head[key.strip().lower()] = value.strip()
        data = await self.reader.readexactly(int(head.get("content-length", "0")))
        return status, head, data

    def close(self) -> None:
        self.writer.close()


async def closed_loop(url: str, clients: int, duration_s: float, body_of,
                      path: str = "/v1/embeddings", first_bodies: dict[int, bytes] | None = None
                      ) -> list[tuple[int, float]]:
    """``clients`` keep-alive connections, each sending ``body_of(i)`` back to back for
    ``duration_s``; returns (status, seconds) per request. A connection the server closes is
    reopened. ``first_bodies``, where given, gets the first answer's body of each status
    (its first 500 bytes): what a rare status said."""
    out: list[tuple[int, float]] = []
    end = time.monotonic() + duration_s
    counter = iter(range(10**9))

    async def client() -> None:
        conn = await Conn.open(url)
        try:
            while time.monotonic() < end:
                start = time.monotonic()
                try:
                    status, _, answer = await conn.post(path, body_of(next(counter)))
                    if first_bodies is not None:
                        first_bodies.setdefault(status, answer[:500])
                except (ConnectionError, asyncio.IncompleteReadError, IndexError):
                    conn.close()
                    conn = await Conn.open(url)
                    status = 0
                out.append((status, time.monotonic() - start))
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return out
