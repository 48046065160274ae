"""The voucher sweep (R4.8): inputs across every size range, run at every allowed count, and
whether all answers were bit-identical to the configured count's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.adaptive import output_bits


@dataclass
class SweepResult:
    comparisons: int = 0
    mismatches: int = 0
    by_range: dict[int, list[int]] = field(default_factory=dict)  # lo -> [comparisons, bad]
    first_mismatch: dict | None = None


def sweep_batches(max_tokens: int, seed: int = 0) -> list[TokenBatch]:
    """Deterministic batches: every length 3..16 (where kernels switch paths), then
    log-spaced lengths up to the limit, each alone and four to a batch."""
    rng = np.random.default_rng(seed)
    lengths = sorted({*range(3, 17), *(int(x) for x in np.geomspace(17, max_tokens, 10))})

    def row(n: int) -> list[int]:
        return [101, *(int(t) for t in rng.integers(1000, 29000, n - 2)), 102]

    batches = [pad([row(n)]) for n in lengths]
    for n in lengths[::3] + [max_tokens]:
        batches.append(pad([row(n), row(max(3, n // 2)), row(max(3, n - 1)), row(3)]))
    return batches


def sweep(forward: Callable[[TokenBatch, int], ForwardResult], configured: int,
          counts: tuple[int, ...], batches: list[TokenBatch],
          progress: Callable[[int, int, SweepResult], None] | None = None) -> SweepResult:
    result = SweepResult()
    for i, batch in enumerate(batches):
        reference = forward(batch, configured).outputs
        lo = size_range(batch.padded_tokens)[0]
        tally = result.by_range.setdefault(lo, [0, 0])
        for n in counts:
            if n == configured:
                continue
            out = forward(batch, n).outputs
            result.comparisons += 1
            tally[0] += 1
            if not np.array_equal(output_bits(out), output_bits(reference)):
                result.mismatches += 1
                tally[1] += 1
                if result.first_mismatch is None:
                    at = np.argwhere(output_bits(out) != output_bits(reference))[0]
                    result.first_mismatch = {
                        "padded_tokens": batch.padded_tokens, "rows": batch.rows,
                        "threads": (configured, n), "first_index": at.tolist(),
                        "values": (float(reference[tuple(at)]), float(out[tuple(at)]))}
        if progress is not None:
            progress(i + 1, len(batches), result)
    return result
