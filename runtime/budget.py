"""The CPU budget of this process and the intra-op thread count a worker defaults to (R2.3).

Budget = the smaller of the affinity mask and the cgroup CPU quota (v2 ``cpu.max``, else v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), walking the process's cgroup and its parents.
A fractional quota rounds down, never below one CPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from vllm_srun.runtime.errors import ConfigError

THREADS_ENV = "VLLM_SRUN_CPU_THREADS"
MAX_DEFAULT_THREADS = 16


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu-controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(root: Path, rel: str) -> list[Path]:
    """The cgroup folder for ``rel`` and each parent up to ``root``, deepest first."""
    parts = [p for p in rel.strip("/").split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_v2(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or "100000")
    except ValueError:
        return None


def _read_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text().strip())
        period = int((folder / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cgroup_cpus(sys_root: Path = Path("/sys/fs/cgroup"),
                proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, or None."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    quotas: list[float] = []
    if v2 is not None:
        quotas += [q for f in _ancestors(sys_root, v2) if (q := _read_v2(f)) is not None]
    if v1 is not None:
        for base in (sys_root / "cpu", sys_root / "cpu,cpuacct", sys_root / "cpuacct,cpu"):
            if base.is_dir():
                quotas += [q for f in _ancestors(base, v1) if (q := _read_v1(f)) is not None]
                break
    return min(quotas) if quotas else None


def cpu_budget(affinity: int | None = None, quota: float | None = None,
               *, read_cgroup: bool = True) -> int:
    """CPUs this process may use: min(affinity mask, cgroup quota), at least 1."""
    cpus = affinity if affinity is not None else affinity_cpus()
    if quota is None and read_cgroup:
        quota = cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def default_threads(budget: int) -> int:
    """Half the budget, rounded down, in 1..16."""
    return max(1, min(MAX_DEFAULT_THREADS, budget // 2))


def parse_threads(value: str, name: str) -> int:
    """A positive integer thread count, or a ConfigError naming ``name``."""
    text = value.strip()
    try:
        count = int(text, 10)
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}") from None
    if count < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return count


def configured_threads(budget: int, flag: int | None = None,
                       env: Mapping[str, str] | None = None) -> int:
    """The per-worker count: ``--threads``, else $VLLM_SRUN_CPU_THREADS, else the default;
    capped by the budget."""
    env = os.environ if env is None else env
    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--threads must be a positive integer, got {flag}")
        return min(flag, budget)
    raw = env.get(THREADS_ENV)
    if raw is not None and raw != "":
        return min(parse_threads(raw, THREADS_ENV), budget)
    return default_threads(budget)
