"""pytest-benchmark fixtures: the real L6 model on both backends."""

from __future__ import annotations

import pytest

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.threads import ThreadContext


@pytest.fixture(scope="session")
def context():
    ctx = ThreadContext()
    yield ctx
    ctx.shutdown()


@pytest.fixture(scope="session")
def backends():
    manifest = resolve("all-MiniLM-L6-v2")
    return {name: load_backend(manifest, name) for name in ("onnxruntime", "torch")}
