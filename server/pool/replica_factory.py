"""Making one replica of a deployment (R5.1): an attached endpoint's client, or a managed
worker (in-process for the one-worker shorthand, else a process on an owner-only socket),
whose spec comes from the deployment's config and the process-wide :class:`PoolOptions`.
Every replica gets a load account; an attached endpoint's is shared by every deployment that
attaches it, so its load is counted once per physical worker.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from vllm_srun.runtime.budget import configured_threads
from vllm_srun.runtime.device import is_gpu
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.types import EngineArgs, Manifest
from vllm_srun.server.pool.config import (
    Config,
    DeploymentConfig,
    ReplicaConfig,
    endpoint_key,
)
from vllm_srun.server.pool.replicas import (
    AttachedReplica,
    LoadAccount,
    LocalReplica,
    ProcessReplica,
    Replica,
)
from vllm_srun.server.pool.states import ReplicaState
from vllm_srun.server.worker.assembly import Worker, fork_shadow_zygote
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner.modes import AdaptiveMode, effective_mode

# batch limits a worker starts with where the config sets none, until it calibrates (R3.2)
PROVISIONAL_SEQS, PROVISIONAL_TOKENS = 32, 8192

Transition = Callable[[Replica, ReplicaState, str], None]


@dataclass
class PoolOptions:
    """Process-wide settings every managed worker inherits."""

    budget: int
    mode: int = 0
    max_threads: int | None = None
    record: str | None = None
    log_level: str = "warning"
    socket_dir: str | None = None
    learning_share: float | None = None  # None: the tuner's default


def engine_args(options: PoolOptions, dep: DeploymentConfig) -> EngineArgs:
    e = dep.engine
    return EngineArgs(num_threads=configured_threads(options.budget, e.num_threads),
                      max_num_seqs=e.max_num_seqs or PROVISIONAL_SEQS,
                      max_num_batched_tokens=e.max_num_batched_tokens or PROVISIONAL_TOKENS,
                      timeout_ms=e.timeout_ms, cache_entries=e.cache_entries,
                      concurrent_forwards=e.concurrent_forwards)


def check_concurrent_forwards(options: PoolOptions, config: Config) -> None:
    """Refuse a deployment whose worker would run several forwards at once where it cannot:
    on a GPU, in a deployment of several workers (each process already runs a forward of its
    own, and their counts share the host's cores through the core ledger, one forward per
    worker), or with more threads together than the CPU budget at the configured count
    (with adaptive threads a forward takes a count above it only where it fits beside the
    others running: ``AdaptiveThreads._beside_others``)."""
    for name, dep in config.deployments.items():
        n = dep.engine.concurrent_forwards
        if n == 1:
            continue
        key = (f"global.model_catalog.deployments.{name}.engine.concurrent_forwards "
               f"(--concurrent-forwards) {n}")
        if not dep.shorthand or dep.endpoint is not None:
            raise ConfigError(f"{key}: several forwards at once apply to a one-worker "
                              "deployment (its worker in the server's process); with several "
                              "workers each runs its own forwards")
        if is_gpu(dep.device or "cpu"):
            raise ConfigError(f"{key}: several forwards at once apply to CPU workers only")
        threads = configured_threads(options.budget, dep.engine.num_threads)
        if n * threads > options.budget:
            raise ConfigError(f"{key}: {n} forwards at once x {threads} threads each is more "
                              f"than the CPU budget of {options.budget}; lower --threads or "
                              "this")


def adaptive_mode(options: PoolOptions, dep: DeploymentConfig) -> AdaptiveMode:
    """The deployment's adaptive-threads mode: its config key, else the process's."""
    return effective_mode(dep.adaptive_threads, AdaptiveMode(options.mode))


def worker_spec(options: PoolOptions, dep: DeploymentConfig, device: str) -> WorkerSpec:
    """What a managed worker of ``dep`` on ``device`` is started with."""
    return WorkerSpec(dep.artifact, dep.backend or "onnxruntime", engine_args(options, dep),
                      options.budget, adaptive_mode(options, dep), options.max_threads,
                      options.record, device=device,
                      set_max_num_seqs=dep.engine.max_num_seqs,
                      set_max_num_batched_tokens=dep.engine.max_num_batched_tokens,
                      revision=dep.revision,
                      dtype=dep.dtype or "float32", quality_gate=dep.thresholds(),
                      share_cores=not dep.shorthand and not is_gpu(device),
                      learning_share=options.learning_share)


def fork_in_process_zygotes(options: PoolOptions, config) -> None:
    """The in-process worker of a one-worker deployment learns in the server's own process:
    fork that process's zygote (its shadow process to be) before anything loads
    (``tuner/zygote.py``)."""
    for dep in config.deployments.values():
        if dep.shorthand:
            for r in dep.placements():
                if r.endpoint is None:
                    fork_shadow_zygote(worker_spec(options, dep, r.device))


class ReplicaFactory:
    """Makes replicas named ``<deployment>-<n>`` (n counts up per deployment, never reused),
    each with its account in ``accounts`` and, for a worker process, its socket in
    ``socket_dir`` (owner-only, R7.3)."""

    def __init__(self, options: PoolOptions, accounts: dict[str, LoadAccount],
                 on_load_failure: Callable[[str], None] | None = None) -> None:
        self.options, self.accounts, self.on_load_failure = options, accounts, on_load_failure
        self.socket_dir = options.socket_dir or tempfile.mkdtemp(prefix="vllm-srun-workers-")
        os.chmod(self.socket_dir, 0o700)  # R7.3: only the owner can reach the sockets
        self._ids: collections.Counter[str] = collections.Counter()
        self._socket_n = 0

    def new(self, name: str, dep: DeploymentConfig, r: ReplicaConfig,
            manifest: Manifest | None, where: str, on_transition: Transition) -> Replica:
        """A replica of deployment ``name`` placed as ``r`` says (``where``: its config key,
        for errors), not started."""
        rid = f"{name}-{self._ids[name]}"
        self._ids[name] += 1
        expected = {k: v for k, v in (("max_num_seqs", dep.engine.max_num_seqs),
                                      ("max_num_batched_tokens",
                                       dep.engine.max_num_batched_tokens)) if v is not None}
        if r.endpoint is not None:
            account = self.accounts.setdefault(r.endpoint, LoadAccount(r.endpoint))
            return AttachedReplica(rid, r.endpoint, account, expected, on_transition,
                                   endpoint=r.endpoint, model=r.model,
                                   api_key=endpoint_key(r, where))
        account = self.accounts[rid] = LoadAccount(rid)
        spec = worker_spec(self.options, dep, r.device)
        if dep.shorthand:
            return LocalReplica(rid, r.device, account, expected, on_transition,
                                worker=Worker(spec, manifest, replica_id=rid),
                                on_load_failure=self.on_load_failure)
        self._socket_n += 1
        return ProcessReplica(rid, r.device, account, expected, on_transition,
                              socket_path=os.path.join(self.socket_dir,
                                                       f"w{self._socket_n}.sock"),
                              spec=spec, log_level=self.options.log_level)

    def close(self) -> None:
        """Remove the socket folder (left in place while anything is still in it)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.socket_dir)
