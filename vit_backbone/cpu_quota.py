"""How many CPUs this process may really use: the affinity mask, capped by the cgroup CPU quota.

``os.cpu_count()`` (and torch's default thread count) sees every core of the host, but a container started
with ``--cpus 1`` (cgroup v2 ``cpu.max`` = ``100000 100000``) or a Kubernetes CPU limit gets one core's worth
of time: as many threads as host cores then only contend with each other. This module reads the limits;
the caller decides what to do with the number (the server sets torch's thread count from it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["available_cpus", "cgroup_cpu_limit"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # cgroup v1 writes -1 for "no quota"
        return None
    return q / p


def cgroup_cpu_limit(cgroup_root: Path = _CGROUP_ROOT) -> float | None:
    """The CPU quota in cores (``1.5`` for ``--cpus 1.5``), or None when no quota is set or none is readable.

    cgroup v2: ``<root>/cpu.max`` holds ``"QUOTA PERIOD"`` or ``"max PERIOD"``. cgroup v1:
    ``<root>/cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (or under ``cpu,cpuacct``). Inside a container
    its own cgroup is mounted at the root, which is the case this reads.
    """
    v2 = _read(cgroup_root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota = _read(cgroup_root / folder / "cpu.cfs_quota_us")
        period = _read(cgroup_root / folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return _ratio(quota, period)
    return None


def available_cpus(
    cgroup_root: Path = _CGROUP_ROOT,
    *,
    affinity: set[int] | None = None,
    cpu_count: int | None = None,
) -> int:
    """CPUs worth using: the affinity mask's size, capped by the cgroup quota rounded down, at least 1
    (``--cpus 1.5`` → 1: a fractional core is not worth a thread that would wait on the quota).

    ``affinity`` defaults to ``os.sched_getaffinity(0)`` (where the platform has it) and ``cpu_count`` to
    ``os.cpu_count()``; both can be given, with ``cgroup_root``, to read another environment (tests).
    """
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = os.sched_getaffinity(0)
    cpus = len(affinity) if affinity else (cpu_count if cpu_count is not None else os.cpu_count() or 1)
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(1, cpus)
