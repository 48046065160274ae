"""A managed worker process (R5.1, R5.9, R7.3): one replica's own copy of the weights, its
engine, cache and (on the CPU) adaptive threads, serving the worker protocol
(``protocol.py``) on a Unix socket in a directory only the owner can open.

    python -P -m vllm_srun.server.worker.main --socket DIR/w0.sock --spec '{"model": ...}'

``-P`` keeps the user's working directory off the module path, so a ``server.py`` there
cannot shadow anything (R9.1). ``/health`` is answered by the event loop, so a worker whose
forward hangs still answers it; that is why the pool also counts timeouts (R5.6).

Fault injection is not reachable from here (R9.2): :func:`main` takes a ``wrap_backend``
callable that only the test-only launcher (``tests/faults.py``) passes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vllm_srun.runtime.errors import RuntimeFault
from vllm_srun.runtime.lifetime import die_with_parent
from vllm_srun.runtime.runner import Runner
from vllm_srun.server.worker import protocol
from vllm_srun.server.worker.assembly import Worker, fork_shadow_zygote
from vllm_srun.server.worker.bridge import run
from vllm_srun.server.worker.logs import configure as configure_logging
from vllm_srun.server.worker.logs import log_format
from vllm_srun.server.worker.metrics import WorkerMetrics
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.server.worker.trace import REQUEST_ID_HEADER, begin

log = logging.getLogger("vllm_srun.worker")


@dataclass
class Loaded:
    """What the loading thread has produced so far."""

    runner: Runner | None = None
    reason: str = "loading"
    done: threading.Event = field(default_factory=threading.Event)


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def _error(code: str, message: str) -> Response:
    return _json(protocol.error_body(code, message), protocol.error_status(code))


def create_worker_app(worker: Worker, loaded: Loaded, metrics: WorkerMetrics) -> Starlette:
    async def health(_request: Request) -> Response:
        runner = loaded.runner
        if runner is None:
            return _error("not_ready", loaded.reason)
        if not runner.ready:  # loaded, but a start-up check (the golden check) refused it
            return _error(protocol.CHECK_FAILED, loaded.reason)
        a = runner.args
        return _json(protocol.health_body(runner.manifest.name, runner.manifest.revision,
                                          worker.spec.device, os.getpid(), a.num_threads,
                                          a.max_num_seqs, a.max_num_batched_tokens,
                                          worker.precision_report()))

    async def work(request: Request) -> Response:
        runner = loaded.runner
        if runner is None or not runner.ready:
            return _error("not_ready", loaded.reason)
        trace = begin(request.headers.get(REQUEST_ID_HEADER))
        try:
            order = protocol.Work.decode(await request.body())
            out, tokens = await run(runner, order.texts, order.truncate,
                                    time.monotonic() + order.timeout_ms / 1000, order.field,
                                    order.raw)
        except protocol.ProtocolError as exc:
            return _error("invalid_request", str(exc))
        except RuntimeFault as exc:
            return _error(exc.code, str(exc))
        body, headers = protocol.encode_rows(out, tokens)
        return Response(body, media_type="application/octet-stream",
                        headers={**headers, **trace.timing_headers()})

    async def threads(_request: Request) -> Response:
        return _json(worker.threads_report(loaded.runner))

    async def prometheus(_request: Request) -> Response:
        hits = loaded.runner.cache.hits if loaded.runner is not None else 0
        limited = worker.cores.limited if worker.cores is not None else None
        bad = loaded.runner.engine.non_finite if loaded.runner is not None else 0
        return Response(metrics.render(hits, worker.threads_report(loaded.runner), limited,
                                       bad),
                        media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route(protocol.HEALTH, health),
                             Route(protocol.WORK, work, methods=["POST"]),
                             Route(protocol.THREADS, threads),
                             Route(protocol.METRICS, prometheus)])


def _load_in_background(worker: Worker, loaded: Loaded, metrics: WorkerMetrics) -> None:
    def load() -> None:
        try:
            runner = worker.load_to_serve(metrics.record_forward)
        except Exception as exc:  # the pool sees the exit and restarts with backoff
            log.error("worker_load_failed error=%s", exc)
            os._exit(3)
        if not runner.ready:
            loaded.reason = runner.not_ready_reason or "not ready"
        loaded.runner = runner
        loaded.done.set()

    threading.Thread(target=load, name="worker-load", daemon=True).start()


def _owner_only_socket(path: str) -> socket.socket:
    """Bind the socket ourselves: uvicorn's own ``uds`` makes it world-writable (0666). The
    folder is owner-only already; the socket file is too."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(256)
    return sock


# An idle connection from the front end stays open this long, well past the front end's own
# expiry (``pool.replicas.process.IDLE_EXPIRY_S``, 5 s). With both at uvicorn's and httpx's
# 5 s, the front end sent on connections the worker was closing under a 10x-capacity soak
# ("Server disconnected without sending a response": a 503 to the caller).
KEEP_ALIVE_S = 60


def main(argv: list[str] | None = None, wrap_backend=None) -> int:
    """Run one worker. ``wrap_backend`` (tests only) wraps the loaded backend."""
    parser = argparse.ArgumentParser(prog="vllm-srun-worker")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--replica-id", default="worker")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, log_format(None), f"worker[{os.getpid()}] ")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    import uvicorn

    spec = WorkerSpec.from_json(args.spec)
    fork_shadow_zygote(spec)
    worker = Worker(spec, wrap_backend=wrap_backend, replica_id=args.replica_id)
    loaded, metrics = Loaded(), WorkerMetrics(args.replica_id)
    sock = _owner_only_socket(args.socket)
    _load_in_background(worker, loaded, metrics)
    config = uvicorn.Config(create_worker_app(worker, loaded, metrics), log_level="warning",
                            access_log=False, log_config=None, loop="uvloop", http="httptools",
                            timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
