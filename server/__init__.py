"""The serving side of vllm-srun, in three layers; imports point one way (checked by
import-linter, ``tests/test_layers.py``):

- ``frontend/`` runs in the front-end process: the HTTP API (``routes.py``), its assembly
  (``app.py``), the command line (``cli.py``, ``threads_cli.py``), admission and the API key,
  metrics, and the one table from pool and runtime errors to HTTP status, code and headers
  (``errors.py``). Ray Serve's wrapper lives here too.
- ``pool/`` decides and supervises, with no HTTP framework: the rules as pure functions over
  frozen snapshots (``dispatch.py``: which replica, admit or refuse; ``plan.py``: what a new
  config keeps, starts and retires; ``backoff.py``; ``outlier.py``: ejection), the states
  (``states.py``), the replica kinds (``replicas/``) and their transport, the config schema,
  and ``Pool`` / ``DeploymentPool`` that apply the rules.
- ``worker/`` is what runs behind a socket (or in-process for the one-worker shorthand): the
  worker process (``main.py``), its order (``spec.py``: ``WorkerSpec``), the assembly of its
  runner and tuner (``assembly.py``: ``Worker``), its metrics, and the one wire protocol both
  sides import (``protocol.py``).

Names: a *deployment* is an entry of ``config.yaml`` (``DeploymentConfig``); the pool's view of
one is a ``DeploymentPool``; one replica's engine is a ``Worker`` built from a ``WorkerSpec``.
"""
