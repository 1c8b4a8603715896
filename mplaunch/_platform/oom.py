"""How many processes the OOM killer has ended in a process's memory cgroup: ``oom_kill`` in ``memory.events``
(v2) or ``memory.oom_control`` (v1, Linux 4.13+). The kernel counts a kill in the victim's own cgroup,
whichever limit was hit, so a process's cgroup count rises when it is killed; the root cgroup has none."""

from __future__ import annotations

import functools
import os

from mplaunch._platform.cgroup import _memberships, _mounts, _read


def oom_counters(pid: int, root: str = "/") -> tuple[str, ...]:
    """Return the files holding the ``oom_kill`` count of live (or unreaped) ``pid``'s memory cgroup."""
    cgroup = _read(os.path.join(root, f"proc/{pid}/cgroup"))
    return () if cgroup is None else _counters(root, cgroup)


@functools.lru_cache(maxsize=16)
def _counters(root: str, cgroup: str) -> tuple[str, ...]:
    """Return the counter files of a process in ``cgroup`` (cached: mounts do not move)."""
    mountinfo = _read(os.path.join(root, "proc/self/mountinfo"))
    if mountinfo is None:
        return ()
    mounts = _mounts(mountinfo)
    found = []
    for controllers, path in _memberships(cgroup):
        version = 1 if controllers else 2
        if (version == 1 and "memory" not in controllers) or path in ("/", ""):
            continue
        for fstype, mount_root, mount_point, options in mounts:
            if (version == 2) != (fstype == "cgroup2") or (version == 1 and "memory" not in options):
                continue
            relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else None
            if relative is None or relative.startswith(".."):
                continue
            name = "memory.events" if version == 2 else "memory.oom_control"
            counter = os.path.normpath(os.path.join(root, mount_point.lstrip("/"), relative, name))
            if os.path.exists(counter):
                found.append(counter)
            break
    return tuple(found)


def oom_kills(counters: tuple[str, ...]) -> int | None:
    """Return the sum of the ``oom_kill`` counts in ``counters``, or ``None`` when none can be read."""
    total, known = 0, False
    for counter in counters:
        for line in (_read(counter) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                total, known = total + int(value), True
    return total if known else None
