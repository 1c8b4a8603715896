"""How many CPUs this process may use: its affinity mask, capped by its cgroups' CPU quota."""

from __future__ import annotations

import math
import os

from mplaunch._platform.cgroup import cpu_limit


def usable_cpu_count() -> int:
    """Return the number of CPUs this process may use, at least 1: the smaller of its affinity mask and its
    cgroup CPU quota (Docker ``--cpus``, Kubernetes limits; v1 and v2), the quota rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_limit()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)
