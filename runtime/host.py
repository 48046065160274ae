"""The host fingerprint (R4.9): what decides whether answers survive a change of thread count.

CPU model and flags, the CPU budget, and the versions of the libraries that compute the
forward for the backend (torch with its MKL and oneDNN builds; onnxruntime).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
from pathlib import Path

from vllm_srun.runtime.types import BackendName


def _cpu() -> dict[str, str]:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": model, "flags": flags}
    for key, name in (("model name", "model"), ("flags", "flags"), ("Features", "flags")):
        m = re.search(rf"^{key}\s*:\s*(.*)$", text, re.MULTILINE)
        if m:
            if name == "model":
                model = m.group(1).strip()
            else:
                flags = " ".join(sorted(m.group(1).split()))
    return {"model": model, "flags": flags}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _torch_builds() -> dict[str, str]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    config = torch.__config__.show()
    out = {}
    for key, pattern in (("mkl", r"Intel\(R\) (?:oneAPI )?Math Kernel Library Version ([\d.]+)"),
                         ("onednn", r"(?:oneDNN|MKL-DNN) v([\d.]+)"), ("openmp", r"OpenMP (\d+)")):
        m = re.search(pattern, config)
        out[key] = m.group(1) if m else "absent"
    return out


# Bumped when the runtime's own arithmetic changes answers' bits (2: mean pooling accumulates
# in float64), so a host's stored golden answers and learned counts start afresh, not fail.
ANSWERS_VERSION = 2
# The same for the torch backend's kernels alone (1: bfloat16 ``Linear`` weights packed for
# oneDNN, ``torch_fast.py``; 2: an attention's three projections one packed product), so
# onnxruntime's learnings stay.
TORCH_ANSWERS = 2


def host_fingerprint(backend: BackendName | str, budget: int) -> tuple[str, dict]:
    """(16-hex digest, the details it digests)."""
    backend = BackendName(backend)
    details: dict = {"cpu": _cpu(), "budget": budget, "backend": backend.value,
                     "machine": platform.machine(), "answers": ANSWERS_VERSION}
    if backend is BackendName.TORCH:
        details["torch"] = _version("torch")
        details["torch_answers"] = TORCH_ANSWERS
        details.update(_torch_builds())
        # MKL's conditional bit-wise reproducibility mode changes which kernels run
        details["mkl_cbwr"] = os.environ.get("MKL_CBWR", "")
    else:
        details["onnxruntime"] = _version("onnxruntime")
    digest = hashlib.sha256(json.dumps(details, sort_keys=True).encode()).hexdigest()[:16]
    return digest, details
