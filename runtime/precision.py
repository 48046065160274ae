"""Numeric precision of a deployment's forwards (R1.5): what each backend runs, what the CPU
offers for it, and the policy that picks one for ``auto``.

float32 is the default and the only precision whose answers match sentence-transformers to
1e-5. bfloat16 (torch weights in bfloat16: AMX / AVX-512 BF16 matrix units) and int8 (dynamic
quantization: onnxruntime's QInt8 kernels, torch's ``quantize_dynamic``; VNNI / AMX int8)
serve only after the quality gate (``quality.py``) passed on this host.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_srun.runtime.errors import Unsupported
from vllm_srun.runtime.types import BackendName


class Precision(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"


AUTO = "auto"
DTYPE_CHOICES = (*(p.value for p in Precision), AUTO)

# What each backend runs. onnxruntime's CPU kernels have no bfloat16 MatMul worth serving.
SUPPORTED: dict[BackendName, tuple[Precision, ...]] = {
    BackendName.TORCH: (Precision.FLOAT32, Precision.BFLOAT16, Precision.INT8),
    BackendName.ONNXRUNTIME: (Precision.FLOAT32, Precision.INT8),
}

# CPU flags (``/proc/cpuinfo``) of the units that make a precision fast; any one suffices.
UNITS: dict[Precision, tuple[str, ...]] = {
    Precision.BFLOAT16: ("amx_bf16", "avx512_bf16"),
    Precision.INT8: ("amx_int8", "avx512_vnni", "avx_vnni"),
}


def parse_dtype(value: str, key: str = "--dtype") -> str:
    """A requested dtype: a precision's name or ``auto``; ValueError names ``key``."""
    if value not in DTYPE_CHOICES:
        raise ValueError(f"{key} must be one of {', '.join(DTYPE_CHOICES)}, got {value!r}")
    return value


def check_supported(backend: BackendName | str, precision: Precision | str) -> Precision:
    """The precision, if the backend runs it; else Unsupported naming both."""
    backend = BackendName(backend)
    try:
        precision = Precision(precision)
    except ValueError:
        raise Unsupported(f"precision must be one of {', '.join(p.value for p in Precision)}, "
                          f"got {precision!r}") from None
    if precision not in SUPPORTED[backend]:
        runs = ", ".join(p.value for p in SUPPORTED[backend])
        raise Unsupported(f"backend {backend.value} does not run precision {precision.value} "
                          f"(it runs {runs})")
    return precision


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's flags from ``/proc/cpuinfo`` text (read now when not given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(m.group(1).split()) if m else frozenset()


def missing_units(precision: Precision, flags: frozenset[str]) -> tuple[str, ...]:
    """The unit flags a precision would use that this CPU lacks: all of them when it has
    none (the precision then runs in software, correct but maybe slower than float32)."""
    wanted = UNITS.get(precision, ())
    return () if not wanted or flags & set(wanted) else wanted


@dataclass(frozen=True)
class Trial:
    """One candidate precision measured at load: its gate verdict and its forward time."""

    precision: Precision
    refusal: str | None  # None: passed the gate
    forward_ms: float  # summed best times over the timed shapes


# A reduced precision must beat float32's time by this factor to be chosen: one best-of-3
# timing at load is noisy on a shared host, and a tie is not worth float32's exactness. A
# guess from this host's run-to-run spread, not a sweep.
MARGIN = 1.05


def fastest(trials: list[Trial]) -> tuple[Precision, str]:
    """``auto``'s choice: the fastest precision that passed the gate, float32 when none
    beats it by ``MARGIN`` (so never one slower than float32 on this host). Returns (choice,
    why)."""
    base = next(t for t in trials if t.precision is Precision.FLOAT32)
    passed = [t for t in trials if t.refusal is None and (
        t is base or t.forward_ms * MARGIN < base.forward_ms)]
    best = min(passed, key=lambda t: t.forward_ms)
    timings = ", ".join(f"{t.precision.value} {t.forward_ms:.1f} ms" for t in trials
                        if t.refusal is None)
    refused = "; ".join(f"{t.precision.value} refused: {t.refusal}" for t in trials
                        if t.refusal is not None)
    why = f"fastest that passed the quality gate ({timings} over the timed shapes)"
    if best.precision is not Precision.FLOAT32:
        why += f"; {base.forward_ms / best.forward_ms:.2f}x float32"
    return best.precision, why + (f"; {refused}" if refused else "")
