"""The CPUs this process may use: its affinity mask, bounded by the CPU quota of its cgroup.

`enhancer serve` runs one inference worker per such CPU by default. A container limited to 2 CPUs
on a 64-core host sees 64 CPUs in its affinity mask but gets 2 CPUs' time from the scheduler: the
quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up, is the
bound that matters. Every cgroup from the process's own up to the root can carry a quota; the
smallest counts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (os.cpu_count() where there is no such call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _v2_quota(text: str | None) -> float | None:
    """CPUs of a cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"); None: no limit."""
    if not text:
        return None
    parts = text.split()
    try:
        if parts[0] == "max":
            return None
        quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100_000
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota: str | None, period: str | None) -> float | None:
    """CPUs of cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None: no limit (-1)."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(relative: str) -> list[str]:
    """'/a/b' -> ['a/b', 'a', '']: a cgroup and every cgroup above it, relative to the mount."""
    parts = [p for p in relative.strip().split("/") if p and p != ".."]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The smallest CPU quota on this process's cgroup path (v2 unified, else v1 `cpu`), in CPUs;
    None when no quota is set (or no cgroup filesystem is mounted)."""
    lines = (_read(proc_cgroup) or "").splitlines()
    v2 = v1 = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hid, controllers, path = fields
        if hid == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    quotas: list[float] = []
    if (root / "cgroup.controllers").exists() or (root / "cpu.max").exists():  # a v2 mount at the root
        for rel in _ancestors(v2 or "/"):
            q = _v2_quota(_read(root / rel / "cpu.max"))
            if q is not None:
                quotas.append(q)
    else:
        for base in (root / "cpu", root / "cpu,cpuacct", root / "unified"):
            if base.name == "unified":
                for rel in _ancestors(v2 or "/"):
                    q = _v2_quota(_read(base / rel / "cpu.max"))
                    if q is not None:
                        quotas.append(q)
                continue
            for rel in _ancestors(v1 or "/"):
                q = _v1_quota(_read(base / rel / "cpu.cfs_quota_us"), _read(base / rel / "cpu.cfs_period_us"))
                if q is not None:
                    quotas.append(q)
    return min(quotas) if quotas else None


def available_cpus(affinity: int | None = None, quota: float | str | None = "read") -> int:
    """CPUs this process may use: the affinity mask bounded by the cgroup quota (rounded up), at
    least 1. `affinity` / `quota` replace what is read from the system (tests)."""
    n = affinity_cpus() if affinity is None else affinity
    q = cgroup_cpus() if quota == "read" else quota
    if q is not None:
        n = min(n, math.ceil(q - 1e-9))
    return max(int(n), 1)
