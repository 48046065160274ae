"""The three kinds of replica behind one dispatch (R5.1): in-process (the one-worker
shorthand), a managed worker process (CPU or GPU) and an attached endpoint."""

from vllm_srun.server.pool.replicas.attached import AttachedReplica
from vllm_srun.server.pool.replicas.base import LoadAccount, Replica
from vllm_srun.server.pool.replicas.local import LocalReplica
from vllm_srun.server.pool.replicas.process import ProcessReplica

__all__ = ["AttachedReplica", "LoadAccount", "LocalReplica", "ProcessReplica", "Replica"]
