"""vllm-srun on Ray Serve (optional extra: ``pip install vllm-srun[ray]``).

One Ray Serve replica wraps one engine: the same front end (``server.app``) with a one-worker
deployment inside the actor. Ray places and scales the actors; each actor's CPU allotment is
its thread budget (``num_cpus`` = threads, and the ``OMP_NUM_THREADS`` Ray sets from it), so
a worker never sizes itself from the node's cores.

    from vllm_srun.server.frontend.ray_serve import build
    serve.run(build("all-MiniLM-L6-v2", threads=2, num_replicas=4))

``check_health`` reports our own readiness (golden check, load failures). HTTP through Ray's
proxy reaches the full OpenAI-compatible API; ``handle.embed.remote(texts)`` is the Python
path. ``bytes_router=True`` (alpha: Ray's request-router API is) replaces Ray's
power-of-two-choices with our rule: the replica with the fewest outstanding request bytes,
ties to the least recently assigned, reserving bytes when choosing and releasing them on
completion (counting only once routed would send a burst to one replica).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import defaultdict

from ray import serve
from ray.serve.request_router import RequestRouter

from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.pool import dispatch


def actor_budget() -> int:
    """The CPUs this actor may use: Ray's allotment (OMP_NUM_THREADS, which Ray sets from
    num_cpus) within the affinity mask and cgroup quota."""
    budget = cpu_budget()
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) >= 1:
        budget = min(budget, int(raw))
    return budget


def request_bytes(args: tuple, kwargs: dict) -> int:
    """The dispatch estimate of one handle call: characters of the texts it carries (1 when
    it carries none we can see, e.g. an HTTP request still in Ray's proxy)."""
    total = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list | tuple):
            total += sum(len(v) for v in value if isinstance(v, str))
    return max(total, 1)


class FewestBytesRouter(RequestRouter):
    """R5.2 inside Ray: reserve a request's bytes on the replica chosen, release them when the
    request completes."""

    def initialize_state(self, **_kwargs) -> None:
        self.outstanding: dict = defaultdict(int)
        self.last_assigned: dict = {}
        self.reserved: dict[str, tuple] = {}  # internal request id -> (replica id, bytes)
        self._seq = itertools.count(1)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # the pool's own dispatch order (R5.2), over Ray's candidates; Ray enforces the
        # admission limit itself (max_ongoing_requests)
        ranked = sorted(candidate_replicas, key=lambda r: dispatch.order_key(dispatch.Load(
            r.replica_id, 0, self.outstanding[r.replica_id],
            self.last_assigned.get(r.replica_id, 0))))
        if pending_request is not None and ranked:
            rid = ranked[0].replica_id
            key = pending_request.metadata.internal_request_id
            if key not in self.reserved:
                nbytes = request_bytes(pending_request.args, pending_request.kwargs)
                self.reserved[key] = (rid, nbytes)
                self.outstanding[rid] += nbytes
                self.last_assigned[rid] = next(self._seq)
        return [ranked]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        key = pending_request.metadata.internal_request_id
        rid, nbytes = self.reserved.get(key, (replica_id, 0))
        if rid != replica_id:  # Ray sent it elsewhere: move the reservation
            self.outstanding[rid] -= nbytes
            self.outstanding[replica_id] += nbytes
            self.reserved[key] = (replica_id, nbytes)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        rid, nbytes = self.reserved.pop(internal_request_id, (replica_id, 0))
        self.outstanding[rid] -= nbytes


class Engine:
    """One engine behind Ray Serve: the vllm-srun front end with a one-worker deployment."""

    def __init__(self, model: str, backend: str = "onnxruntime", threads: int = 1,
                 max_num_seqs: int = 32, timeout_ms: int = 30_000) -> None:
        from vllm_srun.server.frontend.app import ServerOptions, ServerState, create_app
        from vllm_srun.server.frontend.auth import api_key
        from vllm_srun.server.pool.config import EngineConfig
        from vllm_srun.server.pool.flags import single
        from vllm_srun.server.pool.pool import PoolOptions

        self.budget = actor_budget()
        if threads > self.budget:
            raise ConfigError(f"threads={threads} exceeds this actor's CPU budget "
                              f"{self.budget} (num_cpus)")
        config = single(model, backend, EngineConfig(num_threads=threads,
                                                     max_num_seqs=max_num_seqs,
                                                     timeout_ms=timeout_ms))
        # the same key as vllm-srun serve: $VLLM_SRUN_API_KEY in the actor's environment (on
        # KubeRay, from a Secret in the pod template); it guards HTTP through Ray's proxy
        self.state = ServerState(config, PoolOptions(self.budget),
                                 ServerOptions(api_key=api_key(None)))
        self.app = create_app(self.state)
        self._started: asyncio.Task | None = None
        self.threads = threads

    async def _ready(self, timeout_s: float = 300) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.state.start())
        await self._started
        for _ in range(int(timeout_s * 10)):
            ok, reason = self.state.ready()
            if ok:
                return
            if "failed" in reason:
                raise RuntimeError(f"vllm-srun engine not ready: {reason}")
            await asyncio.sleep(0.1)
        raise RuntimeError("vllm-srun engine did not become ready")

    async def check_health(self) -> None:
        """Ray's health check, fed by our readiness (load, golden check)."""
        await self._ready()

    async def embed(self, texts: list[str], truncate: bool = False) -> dict:
        """The Python path: rows as lists, plus who answered and at what thread count."""
        await self._ready()
        dep = self.state.pool.deployment_for(None)
        out, tokens, _ = await dep.infer(list(texts), truncate)
        context = serve.get_replica_context()
        return {"data": out.tolist(), "tokens": tokens, "budget": self.budget,
                "threads": self.threads, "pid": os.getpid(),
                "replica": context.replica_id.unique_id if context else None}

    async def __call__(self, request):
        """HTTP through Ray's proxy: the request goes through our ASGI app as is."""
        from starlette.responses import Response

        await self._ready()
        sent: dict = {"status": 500, "headers": [], "body": b""}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["status"], sent["headers"] = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                sent["body"] += message.get("body", b"")

        await self.app(request.scope, request.receive, send)
        headers = {k.decode(): v.decode() for k, v in sent["headers"]
                   if k.lower() != b"content-length"}
        return Response(sent["body"], sent["status"], headers=headers)


def build(model: str, threads: int = 1, num_replicas: int = 1, num_gpus: float = 0,
          backend: str = "onnxruntime", bytes_router: bool = False, **engine):
    """A Ray Serve application: ``num_replicas`` engines of ``threads`` threads each
    (``num_cpus`` = threads), at most 32 requests in flight per engine."""
    options = {"num_replicas": num_replicas, "max_ongoing_requests": dispatch.MAX_IN_FLIGHT,
               "ray_actor_options": {"num_cpus": threads, "num_gpus": num_gpus},
               "health_check_period_s": 5}
    if bytes_router:
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=FewestBytesRouter)
    deployment = serve.deployment(Engine, name="vllm-srun").options(**options)
    return deployment.bind(model, backend, threads, **engine)


def from_config(path: str, bytes_router: bool = False):
    """The same ``config.yaml`` on Ray: the bound deployment's artifact, backend and engine
    arguments; one Ray replica per configured replica (CPU replicas get ``num_cpus`` =
    ``engine.num_threads``, GPU replicas one GPU each)."""
    from vllm_srun.runtime.device import is_gpu
    from vllm_srun.server.pool.config import load

    config = load(path)
    dep = config.deployments[config.bound]
    placements = dep.placements()
    if any(r.endpoint for r in placements):
        raise ConfigError(f"{path}: attached endpoints are not placed by Ray; list devices")
    gpus = 1 if any(is_gpu(r.device) for r in placements) else 0
    e = dep.engine
    return build(dep.artifact, threads=e.num_threads or 1, num_replicas=len(placements),
                 num_gpus=gpus, backend=dep.backend or "onnxruntime",
                 bytes_router=bytes_router, max_num_seqs=e.max_num_seqs or 32,
                 timeout_ms=e.timeout_ms)


def app_builder(args: dict):
    """``import_path: vllm_srun.server.frontend.ray_serve:app_builder`` for ``serve run`` and
    KubeRay's RayService: ``args`` is ``{"config": PATH}`` or ``build``'s keywords."""
    args = dict(args)
    if "config" in args:
        return from_config(args.pop("config"), bool(args.pop("bytes_router", False)))
    return build(**args)
