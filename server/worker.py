"""A managed worker process (R5.1, R5.9, R7.3): one replica's own copy of the weights, its
engine, cache and (on the CPU) adaptive threads, serving the worker API on a Unix socket in a
directory only the owner can open.

    python -P -m vllm_srun.server.worker --socket DIR/w0.sock --spec '{"model": ..., ...}'

(``-P``: the user's working directory is not on the module path, so a ``server.py`` there
cannot shadow anything, R9.1.)

Worker API (the pool is its only client):

- ``GET /health``: 503 while loading; then ``{"status": "ok", "limits": {...}, ...}`` with the
  batch limits this worker runs with (calibrated where the deployment left them unset). It
  is answered by the event loop, so a worker whose forward hangs still answers it; that is why
  the pool also counts timeouts (R5.6).
- ``POST /work``: ``{"texts": [...], "truncate": bool, "timeout_ms": int}`` ->
  ``application/octet-stream`` float32 rows, with ``x-rows``, ``x-dim``, ``x-tokens``
  headers; errors are R7.2 JSON bodies with their status. A text may be a ``[query,
  document]`` pair (reranking, R7.4), and ``"field"`` names the inputs in errors (default
  ``input``). Per-token answers (token classification) add ``x-len``: the body is float32
  ``[x-rows, x-len, x-dim]``, each row zero-padded after its own tokens.
- ``GET /threads``: this worker's adaptive-threads report.

Fault injection is not reachable from here (R9.2): :func:`main` takes a ``wrap_backend``
callable that only a test-only entry point (``tests/faulty_worker.py``) passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import orjson

log = logging.getLogger("vllm_srun.worker")


def die_with_parent(parent: int) -> None:
    """Exit when the front end that started this worker dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so no worker outlives its pool."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


def build_spec(raw: dict):
    from vllm_srun.runtime.types import EngineArgs
    from vllm_srun.server.deployment import DeploymentSpec
    from vllm_srun.tuner.modes import AdaptiveMode

    args = EngineArgs(**raw["args"])
    return DeploymentSpec(model=raw["model"], backend=raw["backend"], args=args,
                          budget=raw["budget"], mode=AdaptiveMode(raw["mode"]),
                          max_threads=raw.get("max_threads"), record_path=raw.get("record"),
                          device=raw["device"], set_max_num_seqs=raw.get("max_num_seqs"),
                          set_max_num_batched_tokens=raw.get("max_num_batched_tokens"),
                          calibrate=True)


def wire_inputs(items: object) -> list:
    """The ``texts`` of a work request: strings, or [text, text] pairs (a reranker's rows)."""
    if not isinstance(items, list):
        raise TypeError("texts must be a list")
    out: list = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif (isinstance(item, list) and len(item) == 2
              and all(isinstance(t, str) for t in item)):
            out.append((item[0], item[1]))
        else:
            raise TypeError("each of texts must be a string or a [text, text] pair")
    return out


def create_worker_app(deployment, state: dict):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from vllm_srun.runtime.errors import RuntimeFault
    from vllm_srun.server.bridge import fault_status, run
    from vllm_srun.server.schemas import error_body

    def error(status: int, code: str, message: str) -> Response:
        return Response(orjson.dumps(error_body(code, message)), status,
                        media_type="application/json")

    async def health(_request: Request) -> Response:
        runner = state.get("runner")
        if runner is None or not runner.ready:
            return error(503, "not_ready", state.get("reason", "loading"))
        a = runner.args
        return Response(orjson.dumps({
            "status": "ok", "model": runner.manifest.name, "revision": runner.manifest.revision,
            "device": deployment.spec.device, "pid": os.getpid(), "num_threads": a.num_threads,
            "limits": {"max_num_seqs": a.max_num_seqs,
                       "max_num_batched_tokens": a.max_num_batched_tokens}}),
            media_type="application/json")

    async def work(request: Request) -> Response:
        runner = state.get("runner")
        if runner is None or not runner.ready:
            return error(503, "not_ready", state.get("reason", "loading"))
        try:
            body = orjson.loads(await request.body())
            texts = wire_inputs(body["texts"])
            truncate, field = bool(body.get("truncate", False)), str(body.get("field", "input"))
            timeout_ms = int(body["timeout_ms"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return error(400, "invalid_request", f"bad worker request: {exc}")
        try:
            out, tokens = await run(runner, texts, truncate,
                                    time.monotonic() + timeout_ms / 1000, field)
        except RuntimeFault as exc:
            status, code = fault_status(exc)
            return error(status, code, str(exc))
        out = out.astype("<f4", copy=False)
        headers = {"x-rows": str(out.shape[0]), "x-dim": str(out.shape[-1]),
                   "x-tokens": str(tokens)}
        if out.ndim == 3:  # per-token answers: [rows, x-len, x-dim]
            headers["x-len"] = str(out.shape[1])
        return Response(out.tobytes(), media_type="application/octet-stream", headers=headers)

    async def threads(_request: Request) -> Response:
        return Response(orjson.dumps(deployment.threads_report(state.get("runner"))),
                        media_type="application/json")

    return Starlette(routes=[Route("/health", health), Route("/work", work, methods=["POST"]),
                             Route("/threads", threads)])


def main(argv: list[str] | None = None, wrap_backend=None) -> int:
    """Run one worker. ``wrap_backend`` (tests only) wraps the loaded backend."""
    parser = argparse.ArgumentParser(prog="vllm-srun-worker")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--replica-id", default="worker")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s worker[%(process)d] %(name)s "
                               "%(message)s")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    import uvicorn

    from vllm_srun.server.deployment import Deployment

    spec = build_spec(json.loads(args.spec))
    deployment = Deployment(spec, wrap_backend=wrap_backend)
    state: dict = {"reason": "loading"}

    def load() -> None:
        try:
            runner = deployment.load()
        except Exception as exc:  # report through /health; the pool sees the exit too
            state["reason"] = f"load failed: {exc}"
            log.error("worker_load_failed error=%s", exc)
            os._exit(3)
        state["runner"] = runner
        if not runner.ready:
            state["reason"] = runner.not_ready_reason or "not ready"

    # Bind the socket ourselves: uvicorn's own ``uds`` makes it world-writable (0666). The
    # folder is owner-only already; the socket file is too.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(args.socket)
    finally:
        os.umask(old)
    os.chmod(args.socket, 0o600)
    sock.listen(256)
    threading.Thread(target=load, name="worker-load", daemon=True).start()
    config = uvicorn.Config(create_worker_app(deployment, state), log_level="warning",
                            access_log=False, loop="uvloop", http="httptools",
                            timeout_graceful_shutdown=5)
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
