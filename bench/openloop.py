"""The open-loop load generator (``bench/openloop.c``), built on demand and driven from Python.

Built with the system C compiler (``cc -O2``) into ``bench/out/`` (git-ignored) the first time
it is needed, and again whenever the source is newer than the binary. A run sends requests on
a Poisson schedule fixed by its seed, each with the next line of a bodies file, and measures
every latency from the request's scheduled send time (see the C file's header).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

SOURCE = Path(__file__).with_name("openloop.c")
BINARY = Path(__file__).parent / "out" / "openloop"


class OpenLoopError(RuntimeError):
    """The generator could not be built or did not run."""


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build() -> Path:
    """The binary, compiled first where it is missing or older than its source."""
    if BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BINARY
    cc = compiler()
    if cc is None:
        raise OpenLoopError("no C compiler (cc or gcc) to build bench/openloop.c")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    tmp = BINARY.with_suffix(f".tmp{os.getpid()}")
    done = subprocess.run([cc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise OpenLoopError(f"cc failed building {SOURCE}: {done.stderr[-2000:]}")
    tmp.replace(BINARY)  # atomic: a concurrent build never runs a half-written binary
    return BINARY


def schedule(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """The scheduled send times (s from the start) a run with these settings uses."""
    out = subprocess.run([str(build()), "--rate", repr(rate_rps), "--duration-s",
                          repr(duration_s), "--seed", str(seed), "--schedule-only"],
                         capture_output=True, text=True, check=True).stdout
    return [float(v) for v in out.split()]


def run(url: str, bodies: Path | str, rate_rps: float, duration_s: float, seed: int,
        connections: int = 64, path: str = "/v1/embeddings", timeout_s: float = 60,
        latencies: Path | str | None = None) -> dict:
    """One open-loop run against ``url`` (http://127.0.0.1:PORT): the generator's JSON
    summary (rates, counts by status class, latency percentiles in ms from schedule)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.port:
        raise OpenLoopError(f"url must be http://HOST:PORT, got {url!r}")
    cmd = [str(build()), "--host", parts.hostname, "--port", str(parts.port), "--path", path,
           "--bodies", str(bodies), "--rate", repr(rate_rps), "--duration-s", repr(duration_s),
           "--seed", str(seed), "--connections", str(connections), "--timeout-s",
           repr(timeout_s), *(["--latencies", str(latencies)] if latencies else [])]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=duration_s + timeout_s + 60)
    if done.returncode:
        raise OpenLoopError(f"openloop exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def read_latencies(path: Path | str) -> list[dict]:
    """A ``--latencies`` file: per request, its scheduled, sent and done times (s from the
    start; -1 where never sent or answered) and status (0: no answer)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        i, sched, sent, done, status = line.split()
        rows.append({"index": int(i), "scheduled_s": float(sched), "sent_s": float(sent),
                     "done_s": float(done), "status": int(status)})
    return rows


def latencies_ms(rows: list[dict]) -> list[float]:
    """Latency from schedule (ms) of every answered request, in schedule order."""
    return [(r["done_s"] - r["scheduled_s"]) * 1e3 for r in rows if r["status"] > 0]
