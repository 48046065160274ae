"""Adaptive-threads modes and allowed counts (R4.1, R4.2)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

from vllm_srun.runtime.budget import parse_threads
from vllm_srun.runtime.errors import ConfigError

ADAPTIVE_ENV = "VLLM_SRUN_CPU_ADAPTIVE_THREADS"
MAX_THREADS_ENV = "VLLM_SRUN_CPU_MAX_THREADS"


class AdaptiveMode(enum.IntEnum):
    OFF = 0  # no learning
    LEARN = 1  # learn and report; serve at the configured count
    SERVE = 2  # also serve learned counts once verified and vouched for


# the names of ``--adaptive-threads`` and the config key ``adaptive_threads``
MODE_NAMES = {"off": AdaptiveMode.OFF, "learn": AdaptiveMode.LEARN,
              "serve": AdaptiveMode.SERVE}


def parse_mode(env: Mapping[str, str] | None = None) -> AdaptiveMode:
    """$VLLM_SRUN_CPU_ADAPTIVE_THREADS: unset, 0 (off), 1 (learn) or 2 (serve); the names
    off, learn and serve are read too."""
    env = os.environ if env is None else env
    raw = env.get(ADAPTIVE_ENV, "").strip()
    if raw in ("", "0"):
        return AdaptiveMode.OFF
    if raw in ("1", "2"):
        return AdaptiveMode(int(raw))
    if raw in MODE_NAMES:
        return MODE_NAMES[raw]
    raise ConfigError(f"{ADAPTIVE_ENV} must be unset, 0 (off), 1 (learn) or 2 (serve), got "
                      f"{env[ADAPTIVE_ENV]!r}")


def effective_mode(configured: str | None, default: AdaptiveMode) -> AdaptiveMode:
    """A deployment's mode: its ``adaptive_threads`` (which ``--adaptive-threads`` writes)
    when set, else ``default`` (the environment variable's)."""
    return default if configured is None else MODE_NAMES[configured]


MAX_ALLOWED_COUNT = 16  # learning never tries more intra-op threads than this


def max_threads(budget: int, flag: int | None = None,
                env: Mapping[str, str] | None = None) -> int | None:
    """The highest count learning may try (``--max-threads`` / $VLLM_SRUN_CPU_MAX_THREADS),
    capped by the budget; None when neither is set (learning then goes up to the budget)."""
    env = os.environ if env is None else env
    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--max-threads must be a positive integer, got {flag}")
        return min(flag, budget)
    raw = env.get(MAX_THREADS_ENV, "")
    return min(parse_threads(raw, MAX_THREADS_ENV), budget) if raw.strip() else None


def allowed_counts(configured: int, budget: int,
                   top: int | None = None) -> tuple[int, ...]:
    """The counts learning tries (R4.2): 1, the powers of two, the configured count and the
    CPU budget, none above ``top`` (default: the budget) nor above 16; the configured count
    is always in."""
    top = min(budget if top is None else top, budget, MAX_ALLOWED_COUNT)
    counts = {configured}
    n = 1
    while n <= top:
        counts.add(n)
        n *= 2
    if budget <= top:
        counts.add(budget)
    return tuple(sorted(counts))
