"""Batch limits a deployment leaves unset, calibrated when a worker starts (R3.2).

CPU: from a measured latency target. One forward of 4 rows of ``min(max_tokens, 512)`` tokens
at the worker's configured thread count gives its token rate; ``max_num_batched_tokens`` is the
largest power of two that the rate clears in ``CPU_TARGET_S`` (so a short request never waits
behind more than about that much work), clamped to ``[max_tokens, 16384]``.

GPU: from free device memory. ``max_num_batched_tokens`` is the largest power of two whose
activations fit in half the free memory at ``GPU_BYTES_PER_TOKEN_PER_HIDDEN x hidden_size``
bytes per token (a conservative bound for a BERT-style encoder layer's intermediates),
clamped to ``[max_tokens, 65536]``.

``max_num_seqs`` left unset is 32 on both: the pool's admission limit per worker (R5.3).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_srun.runtime import device as devices
from vllm_srun.runtime.types import EngineArgs

log = logging.getLogger(__name__)

CPU_TARGET_S = 0.1
PROBE_TOKENS = 512
CPU_CAP = 16_384
GPU_CAP = 65_536
GPU_BYTES_PER_TOKEN_PER_HIDDEN = 4 * 64
DEFAULT_MAX_NUM_SEQS = 32


def _pow2_floor(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


def probe_row(tokenizer, tokens: int) -> list[int]:
    """A row of exactly ``tokens`` ids from the model's own vocabulary, special tokens
    included (hard-coded ids would fall outside a small vocabulary)."""
    ids = tokenizer.encode(["hello world " * tokens], truncate=True)[0]
    return ids[: tokens - 1] + ids[-1:]


def cpu_tokens(runner, reps: int = 3) -> int:
    """Measure the configured count's token rate and apply the CPU rule. The probe rows are
    at most ``PROBE_TOKENS`` long: a long-context model (8,192 tokens) would otherwise spend
    seconds here on quadratic attention; the clamp still lets one row of the longest input
    through."""
    max_tokens = runner.manifest.max_tokens
    length = min(max_tokens, PROBE_TOKENS)
    rows = [probe_row(runner.tokenizer, length)] * 4
    best = min(runner.engine.forward(rows, runner.args.num_threads).forward_s
               for _ in range(reps))
    rate = len(rows) * length / max(best, 1e-6)
    return min(max(_pow2_floor(rate * CPU_TARGET_S), max_tokens), CPU_CAP)


def gpu_tokens(free_bytes: int, hidden_size: int, max_tokens: int) -> int:
    """The GPU rule, over the free memory the device reports."""
    per_token = GPU_BYTES_PER_TOKEN_PER_HIDDEN * hidden_size
    return min(max(_pow2_floor(free_bytes * 0.5 / per_token), max_tokens), GPU_CAP)


def calibrate(runner, want_seqs: int | None, want_tokens: int | None,
              device: str = "cpu") -> EngineArgs:
    """Fill the unset limits of a started runner and apply them; returns the new args."""
    seqs = want_seqs if want_seqs is not None else DEFAULT_MAX_NUM_SEQS
    if want_tokens is not None:
        tokens = want_tokens
    elif not devices.is_gpu(device):
        tokens = cpu_tokens(runner)
    else:
        tokens = gpu_tokens(devices.gpu_free_bytes(device), runner.manifest.hidden_size,
                            runner.manifest.max_tokens)
    args = dataclasses.replace(runner.args, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    runner.args = runner.engine.args = args
    log.info("limits_calibrated device=%s max_num_seqs=%d max_num_batched_tokens=%d "
             "(set: seqs=%s tokens=%s)", device, seqs, tokens, want_seqs, want_tokens)
    return args
