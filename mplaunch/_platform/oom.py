"""How many processes the kernel's out-of-memory killer has ended in a process's memory cgroup.

The count is ``oom_kill`` in the cgroup's ``memory.events`` (cgroup v2; it includes the cgroup's descendants)
or ``memory.oom_control`` (cgroup v1, Linux 4.13+). The kernel counts a kill in the victim's own cgroup (and,
under v2, in each ancestor), so the count of the cgroup a process runs in rises when that process is killed,
whichever cgroup's limit was hit. A process in the root cgroup has no count to read: it is unknown.
"""

from __future__ import annotations

import functools
import os

from mplaunch._platform.cgroup import _memberships, _mounts, _read


def oom_counters(pid: int, root: str = "/") -> tuple[str, ...]:
    """The files that hold the ``oom_kill`` count of process ``pid``'s memory cgroup (none when unknown).

    Args:
        pid: the process, alive (or a zombie not yet reaped).
        root: the directory that stands for ``/``; tests pass a fake tree.
    """
    cgroup = _read(os.path.join(root, f"proc/{pid}/cgroup"))
    return () if cgroup is None else _counters(root, cgroup)


@functools.lru_cache(maxsize=16)
def _counters(root: str, cgroup: str) -> tuple[str, ...]:
    """The counter files of a process in ``cgroup`` (the text of its ``/proc/<pid>/cgroup``); remembered, as
    the mounts do not move and every worker of a launch is usually in the same cgroup."""
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
    """The sum of the ``oom_kill`` counts in ``counters`` (see :func:`oom_counters`), or ``None`` when none
    can be read. Never raises."""
    total, known = 0, False
    for counter in counters:
        for line in (_read(counter) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                total, known = total + int(value), True
    return total if known else None
