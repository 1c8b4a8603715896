"""How many CPUs this process may use: its affinity mask, capped by its cgroups' CPU quota."""

from __future__ import annotations

import math
import os
import time

from mplaunch._platform.cgroup import cpu_limit

# Seconds a quota read stays current: it changes rarely, and reading it is up to four files.
QUOTA_FRESH_FOR = 1.0

_quota: tuple[float, int, float | None] | None = None  # (when read, by which process, the quota)


def usable_cpu_count() -> int:
    """Return the CPUs this process may use (at least 1): its affinity mask, capped by its cgroup quota rounded up."""
    global _quota
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    now, pid = time.monotonic(), os.getpid()
    if _quota is None or _quota[1] != pid or now - _quota[0] >= QUOTA_FRESH_FOR:
        _quota = (now, pid, cpu_limit())
    quota = _quota[2]
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)
