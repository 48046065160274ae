"""Where the runtime keeps files: a cache folder (exported ONNX) and a data folder (records).

``VLLM_SRUN_CACHE_DIR`` and ``VLLM_SRUN_DATA_DIR`` override; else the XDG folders.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if d := os.environ.get("VLLM_SRUN_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-srun"


def data_dir() -> Path:
    if d := os.environ.get("VLLM_SRUN_DATA_DIR"):
        return Path(d)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "vllm-srun"
