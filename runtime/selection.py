"""Choosing and admitting a deployment's precision at load (R1.5).

How it works: a requested reduced precision is loaded beside float32 and both answer the
quality gate's evaluation set (``quality.py``); the verdict says whether it may serve. ``auto``
does that for every precision the backend runs, times the ones that passed (and float32) on a
few representative shapes at the worker's thread count, and keeps the fastest
(``precision.fastest``). The backends not chosen are closed; float32 alone loads nothing extra.

Invariant: a reduced precision never serves without a passing verdict measured in this
process; a refused one comes back with ``refusal`` set and the worker stays out of dispatch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from vllm_srun.runtime.backend import Backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.precision import (
    AUTO,
    SUPPORTED,
    Precision,
    Trial,
    check_supported,
    cpu_flags,
    fastest,
    missing_units,
)
from vllm_srun.runtime.quality import GateThresholds, figures, gate_batches, verdict
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import BackendName, Manifest, TokenBatch

log = logging.getLogger(__name__)

# What ``auto`` times: a short query, a passage, and a small batch of medium inputs (one of
# each kind the engine serves); best of TIMED_REPEATS after one warm pass.
TIMED_SHAPES = ((1, 16), (1, 128), (8, 64))
TIMED_REPEATS = 3


@dataclass(frozen=True)
class PrecisionChoice:
    """What serves, and why: the gate's thresholds and what it measured per precision."""

    requested: str
    precision: Precision
    reason: str
    thresholds: GateThresholds = GateThresholds()
    measured: dict[str, dict] = field(default_factory=dict)  # precision -> figures
    refusal: str | None = None  # set: the worker must stay out of dispatch
    warning: str | None = None  # the CPU lacks the precision's units

    def report(self) -> dict:
        out = {"requested": self.requested, "chosen": self.precision.value,
               "reason": self.reason,
               "quality_gate": {"thresholds": asdict(self.thresholds),
                                "measured": self.measured}}
        if self.refusal:
            out["refused"] = self.refusal
        if self.warning:
            out["warning"] = self.warning
        return out


def _forward(context: ThreadContext, backend: Backend, batch: TokenBatch, n: int):
    return context.run(n, lambda: backend.forward(batch, n))


def _time_ms(context: ThreadContext, backend: Backend, n: int) -> float:
    rng = np.random.default_rng(0)
    total = 0.0
    for rows, length in TIMED_SHAPES:
        batch = pad([[101, *map(int, rng.integers(1000, 29000, length - 2)), 102]
                     for _ in range(rows)])
        _forward(context, backend, batch, n)
        total += min(_forward(context, backend, batch, n).forward_s
                     for _ in range(TIMED_REPEATS))
    return total * 1000


def _units_warning(precision: Precision, flags: frozenset[str]) -> str | None:
    missing = missing_units(precision, flags)
    if not missing:
        return None
    return (f"precision {precision.value} runs without the CPU units that make it fast: this "
            f"CPU lacks {' and '.join(missing)}; answers are gated as usual, speed may be below "
            "float32's")


def choose(manifest: Manifest, backend_name: BackendName | str, requested: str,
           thresholds: GateThresholds, num_threads: int, load: Callable[[Precision], Backend],
           flags: frozenset[str] | None = None) -> tuple[Backend, PrecisionChoice]:
    """The backend that serves ``requested`` (a precision or ``auto``), and the choice.
    ``load(precision)`` builds a backend; Unsupported when the backend cannot run it."""
    name = BackendName(backend_name)
    if requested == Precision.FLOAT32.value:
        return load(Precision.FLOAT32), PrecisionChoice(requested, Precision.FLOAT32,
                                                        "requested", thresholds)
    auto = requested == AUTO
    candidates = [p for p in SUPPORTED[name] if p is not Precision.FLOAT32] if auto else \
        [check_supported(name, requested)]
    flags = cpu_flags() if flags is None else flags
    loaded: dict[Precision, Backend] = {}
    context = ThreadContext()
    try:
        batches = gate_batches(manifest, Tokenizer(manifest.tokenizer_path, manifest.max_tokens))
        loaded[Precision.FLOAT32] = base = load(Precision.FLOAT32)
        reference = [_forward(context, base, b, num_threads).outputs for b in batches]
        if not auto:  # float32 has answered: no float32 copy beside the one that serves
            base = None
            release([loaded.pop(Precision.FLOAT32)])
        trials, measured = [], {}
        for p in candidates:
            loaded[p] = backend = load(p)
            got = figures(manifest, batches, reference,
                          [_forward(context, backend, b, num_threads).outputs for b in batches])
            measured[p.value] = got.to_dict()
            refusal = verdict(got, thresholds)
            timed = _time_ms(context, backend, num_threads) if auto and refusal is None else 0.0
            trials.append(Trial(p, refusal, timed))
        if auto:
            trials.append(Trial(Precision.FLOAT32, None, _time_ms(context, base, num_threads)))
            chosen, reason = fastest(trials)
            refusal, warning = None, None
        else:
            chosen, refusal = candidates[0], trials[0].refusal
            warning = _units_warning(chosen, flags)
            reason = "requested" + (f"; {refusal}" if refusal else "; passed the quality gate")
    except BaseException:
        for backend in loaded.values():
            backend.close()
        raise
    finally:
        context.shutdown()
    serving, base, backend = loaded.pop(chosen), None, None
    unused = list(loaded.values())
    loaded.clear()
    release(unused)  # empties ``unused``: no reference left here
    choice = PrecisionChoice(requested, chosen, reason, thresholds, measured, refusal, warning)
    _log(manifest, name, choice)
    return serving, choice


def release(backends: list[Backend]) -> None:
    """Close ``backends`` and give their memory back: a torch module refers to itself
    through its forward hook, so only the cycle collector frees it, and glibc keeps freed heap
    pages mapped until trimmed. After a reduced precision is chosen no float32 weights stay
    in the worker (its resident memory is then the reduced copy's, not both)."""
    for backend in backends:
        backend.close()
        discard = getattr(backend, "discard", None)  # torch: its trace's constants emptied
        if discard is not None:
            discard()
    backends.clear()
    gc.collect()
    _trim()


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _log(manifest: Manifest, name: BackendName, choice: PrecisionChoice) -> None:
    if choice.warning:
        log.warning("precision_without_units model=%s precision=%s warning=%r", manifest.name,
                    choice.precision.value, choice.warning)
    level = logging.WARNING if choice.refusal else logging.INFO
    log.log(level, "precision_chosen model=%s backend=%s requested=%s chosen=%s refused=%s "
            "reason=%r", manifest.name, name.value, choice.requested, choice.precision.value,
            choice.refusal is not None, choice.reason)
