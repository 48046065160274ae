"""Adaptive-threads modes and allowed counts (R4.1, R4.2)."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

from vllm_srun.runtime.budget import parse_threads
from vllm_srun.runtime.errors import ConfigError

ADAPTIVE_ENV = "VLLM_SRUN_CPU_ADAPTIVE_THREADS"
MAX_THREADS_ENV = "VLLM_SRUN_CPU_MAX_THREADS"
LEARNING_SHARE_ENV = "VLLM_SRUN_CPU_LEARNING_SHARE"
# the largest paid learning share one may set: past half, learning would take more of the
# CPU than serving (R4.5 amended: a bounded share)
MAX_LEARNING_SHARE = 0.5


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


def learning_share(flag: float | str | None = None,
                   env: Mapping[str, str] | None = None) -> float | None:
    """The paid learning share (``--learning-share`` / $VLLM_SRUN_CPU_LEARNING_SHARE): a
    fraction of served forward time within 0..``MAX_LEARNING_SHARE``; None when neither is
    set (the tuner's default, 0.02)."""
    env = os.environ if env is None else env
    name, raw = ("--learning-share", flag) if flag is not None else \
        (LEARNING_SHARE_ENV, env.get(LEARNING_SHARE_ENV, "").strip() or None)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= MAX_LEARNING_SHARE:
        raise ConfigError(f"{name} must be a fraction of served forward time within "
                          f"0..{MAX_LEARNING_SHARE}, got {raw!r}")
    return value
