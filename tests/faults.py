"""Test-only launcher (R9.2): part of the test suite, never installed, and unreachable from
``vllm-srun serve`` (no flag, variable or file of the product turns any of this on).

    python -m tests.faults [--faults DIR] [--fake-gpus] serve ARGS...
        the real front end (``vllm-srun serve ARGS``) whose managed workers start through this
        file, with the same options, instead of the product's own worker command
    python -P tests/faults.py [--faults DIR] [--fake-gpus] worker ARGS...
        a real worker; with --faults, every forward first reads DIR/<replica id> (else DIR/all)

``--fake-gpus``: the machine seems to have two CUDA and two ROCm devices, and a GPU device
name maps to torch's CPU device with 8 GiB "free", so every GPU code path of the pool and the
worker runs here except the two calls in ``vllm_srun.runtime.device`` that need a real GPU
(``bench/gpu_check`` runs those).

What a fault file says: ``hang`` blocks the forward while the file says so (``/health`` keeps
answering: it runs on the event loop), ``slow MS`` sleeps MS milliseconds first, ``exit`` ends
the process mid-forward.
"""

from __future__ import annotations

import os
import sys
import time


def _read_fault(paths: list[str]) -> str:
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                if text := f.read().strip():
                    return text
        except OSError:
            pass
    return ""


def inject_faults(backend, folder: str, replica_id: str):
    """Wrap ``backend.forward`` with the faults named in ``folder`` (read at every forward)."""
    forward = backend.forward
    paths = [os.path.join(folder, replica_id), os.path.join(folder, "all")]

    def faulty(batch, num_threads):
        fault = _read_fault(paths)
        while fault == "hang":
            time.sleep(0.05)
            fault = _read_fault(paths)
        if fault.startswith("slow "):
            time.sleep(int(fault.split()[1]) / 1000)
        elif fault == "exit":
            os._exit(17)
        return forward(batch, num_threads)

    backend.forward = faulty
    return backend


def _replica_id(argv: list[str]) -> str:
    return argv[argv.index("--replica-id") + 1] if "--replica-id" in argv else "worker"


def _fake_gpus() -> None:
    from vllm_srun.runtime import device

    device.torch_device = lambda text: "cpu"  # the real mapping is tested on its own
    device.gpu_free_bytes = lambda text: 8 << 30
    device.visible_devices = lambda: {"cpu": 1, "cuda": 2, "rocm": 2}


def main(argv: list[str]) -> int:
    options: list[str] = []
    folder = None
    while argv and argv[0].startswith("--"):
        if argv[0] == "--faults":
            folder, argv = argv[1], argv[2:]
            options += ["--faults", folder]
        elif argv[0] == "--fake-gpus":
            _fake_gpus()
            options.append(argv.pop(0))
        else:
            raise SystemExit(f"tests.faults: unknown option {argv[0]!r}")
    role, rest = argv[0], argv[1:]
    if role == "serve":
        from vllm_srun.server.frontend import cli
        from vllm_srun.server.pool.replicas import process

        process.WORKER_COMMAND = (sys.executable, "-P", os.path.abspath(__file__), *options,
                                   "worker")
        return cli.main(["serve", *rest])
    if role == "worker":
        from vllm_srun.server.worker import main as worker

        rid = _replica_id(rest)
        wrap = (lambda b: inject_faults(b, folder, rid)) if folder else None
        return worker.main(rest, wrap_backend=wrap)
    raise SystemExit(f"usage: python -m tests.faults [--faults DIR] [--fake-gpus] "
                     f"serve|worker ARGS (got {role!r})")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
