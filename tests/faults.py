"""Test-only launcher (R9.2): part of the test suite, never installed, and unreachable from
``vllm-srun serve`` (no flag, variable or file of the product turns any of this on).

    python -m tests.faults [--faults DIR] [--fake-gpus VENDOR [--gpu-log FILE]] serve ARGS...
        the real front end (``vllm-srun serve ARGS``) whose managed workers start through this
        file, with the same options, instead of the product's own worker command
    python -P tests/faults.py [--faults DIR] [--fake-gpus VENDOR ...] worker ARGS...
        a real worker; with --faults, every forward first reads DIR/<replica id> (else DIR/all)

``--fake-gpus cuda|rocm``: the machine seems to have two GPUs of that one vendor (a real one
has one vendor's torch build), device 0 with 8 GiB free and device 1 with 2 GiB, so every GPU
code path of the pool and the worker runs here except the two calls in
``vllm_srun.runtime.device`` that need a real GPU (``bench/gpu_check`` runs those). Only the
last step is faked: the torch device the worker asks for (from the product's own mapping) is
checked against the fake machine and noted, and torch's CPU device stands in for it; so is
each free-memory query. ``--gpu-log FILE`` appends those notes as JSON lines
(``{"who": replica id, "torch_device": "cuda:1"}``, ``{"who", "free_bytes_of": "rocm:1"}``), so
a test sees which device each worker asked for.

What a fault file says: ``hang`` blocks the forward while the file says so (``/health`` keeps
answering: it runs on the event loop), ``slow MS`` sleeps MS milliseconds first, ``exit`` ends
the process mid-forward.
"""

from __future__ import annotations

import json
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


FAKE_GPUS = 2  # devices of the fake machine's one vendor
FAKE_FREE_BYTES = (8 << 30, 2 << 30)  # free memory each reports, by index


def _fake_gpus(vendor: str, log_path: str | None, who: str) -> None:
    from vllm_srun.runtime import backend, device

    def note(**what: str) -> None:
        if log_path:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"who": who, "pid": os.getpid(), **what}) + "\n")

    def free_bytes(text: str) -> int:
        platform, index = device.parse_device(text)
        if platform != vendor or index >= FAKE_GPUS:  # as a driver without that device fails
            raise RuntimeError(f"fake gpus: no device {text!r} on a machine of {FAKE_GPUS} "
                               f"{vendor} devices")
        note(free_bytes_of=text)
        return FAKE_FREE_BYTES[index]

    class FakeGpuTorch(backend.TorchBackend):
        """The torch backend on the CPU device in place of the GPU it was asked for."""

        def __init__(self, manifest, torch_device: str = "cpu", *rest) -> None:
            if torch_device != "cpu":
                if not torch_device.startswith("cuda:") or \
                        int(torch_device.split(":")[1]) >= FAKE_GPUS:
                    raise RuntimeError(f"fake gpus: torch has no device {torch_device!r}")
                note(torch_device=torch_device)
            super().__init__(manifest, "cpu", *rest)  # rest: the precision

    device.gpu_free_bytes = free_bytes
    device.visible_devices = lambda: {"cpu": 1, vendor: FAKE_GPUS}
    backend.TorchBackend = FakeGpuTorch


def main(argv: list[str]) -> int:
    options: list[str] = []
    folder = vendor = gpu_log = None
    while argv and argv[0].startswith("--"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--faults":
            folder = value
        elif flag == "--fake-gpus" and value in ("cuda", "rocm"):
            vendor = value
        elif flag == "--gpu-log":
            gpu_log = value
        else:
            raise SystemExit(f"tests.faults: unknown option {flag} {value!r}")
        options += [flag, value]
    role, rest = argv[0], argv[1:]
    if vendor is not None:
        _fake_gpus(vendor, gpu_log, _replica_id(rest) if role == "worker" else role)
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
    raise SystemExit(f"usage: python -m tests.faults [--faults DIR] [--fake-gpus cuda|rocm] "
                     f"[--gpu-log FILE] serve|worker ARGS (got {role!r})")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
