"""Forward time per input size per thread count, both backends (pytest bench/ --benchmark-only)."""

from __future__ import annotations

import pytest

from vllm_srun.runtime.budget import cpu_budget
from vllm_srun.runtime.engine import pad

COUNTS = sorted({1, 2, cpu_budget()})


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("tokens", [3, 8, 16, 64, 256])
@pytest.mark.parametrize("num_threads", COUNTS)
def test_forward(benchmark, backends, context, backend, tokens, num_threads):
    impl = backends[backend]
    batch = pad([[101] + [7592] * (tokens - 2) + [102]])
    benchmark.group = f"{backend} {tokens} tokens"
    benchmark(lambda: context.run(num_threads, lambda: impl.forward(batch, num_threads)))
