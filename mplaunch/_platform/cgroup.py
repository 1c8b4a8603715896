"""The CPU bandwidth limit of this process's cgroups (Docker ``--cpus``, Kubernetes CPU limits, systemd
``CPUQuota``), read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``.

The affinity mask (``os.sched_getaffinity``), ``os.cpu_count``, ``os.process_cpu_count`` (3.13) and psutil
ignore these quotas, so on a large host a container limited to 4 CPUs would see every core of the host. The
limit of a cgroup also bounds every cgroup below it, so the smallest quota along the process's cgroup path, up
to the root of each mounted hierarchy, is the one that applies (cgroup v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, cgroup v2 ``cpu.max``). joblib/loky read only the fixed paths
``/sys/fs/cgroup/cpu.max`` and ``/sys/fs/cgroup/cpu/cpu.cfs_quota_us``, which miss nested cgroups.
"""

from __future__ import annotations

import functools
import os
import re

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _read(path: str) -> str | None:
    """The text of ``path``, or ``None``. Read with plain system calls: a launch reads a few of these files
    each time, and a text file object costs far more than the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    r"""Undo mountinfo's octal escapes of a space, tab, newline or backslash in a path (``\040``)."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, root, mount point, super options)`` of every cgroup file system in ``mountinfo``."""
    found = []
    for line in mountinfo.splitlines():
        left, separator, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not separator or len(fields) < 5 or len(tail) < 1 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(tail[2].split(",")) if len(tail) > 2 else set()
        found.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), options))
    return found


def _memberships(cgroup: str) -> list[tuple[set[str], str]]:
    """``(controllers, path)`` of each line of ``/proc/self/cgroup``; cgroup v2 has no controllers listed."""
    found = []
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.append((set(parts[1].split(",")) - {""}, parts[2]))
    return found


def _quota(directory: str, version: int) -> float | None:
    """The CPUs allowed by one cgroup directory's own limit, or ``None`` for none."""
    if version == 2:
        text = _read(os.path.join(directory, "cpu.max"))
        fields = text.split() if text else []
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota, period = fields
    else:
        quota = (_read(os.path.join(directory, "cpu.cfs_quota_us")) or "").strip()
        period = (_read(os.path.join(directory, "cpu.cfs_period_us")) or "").strip()
    try:
        value, length = int(quota), int(period)
    except ValueError:
        return None
    return value / length if value > 0 and length > 0 else None  # -1 (v1): no limit


def _directories(mount_root: str, mount_point: str, path: str, root: str) -> list[str]:
    """The cgroup directories from ``path`` (the process's cgroup) up to the mount point, deepest first."""
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
    if relative.startswith(".."):
        relative = "."
    base = os.path.join(root, mount_point.lstrip("/"))
    found = []
    while True:
        found.append(os.path.normpath(os.path.join(base, relative)))
        if relative in (".", ""):
            return found
        relative = os.path.dirname(relative)


def cpu_limit(root: str = "/") -> float | None:
    """Return the CPUs this process's cgroups allow (quota / period, e.g. ``1.5``), or ``None`` for no limit.

    The smallest limit along the process's cgroup path (its own cgroup and every ancestor visible in the
    mount) over the cgroup v2 hierarchy and the v1 hierarchy with the ``cpu`` controller. Never raises:
    anything unreadable counts as no limit. The limit files are read at every call (a quota can change while
    the process runs, e.g. ``docker update --cpus``); where they are is worked out once per cgroup path.

    Args:
        root: the directory that stands for ``/`` (``proc/self/...`` and the mount points are read below
            it); tests pass a fake tree.
    """
    cgroup = _read(os.path.join(root, "proc/self/cgroup"))
    if cgroup is None:
        return None
    limits = [
        quota
        for directory, version in _limit_directories(root, cgroup, "cpu")
        if (quota := _quota(directory, version)) is not None
    ]
    return min(limits) if limits else None


def pids_limit(root: str = "/") -> tuple[int, int] | None:
    """Return ``(pids.max, pids.current)`` of the cgroup with the least room for new processes and threads
    along this process's cgroup path (Docker ``--pids-limit``, Kubernetes ``podPidsLimit``, systemd
    ``TasksMax``), over cgroup v2 and the v1 ``pids`` hierarchy, or ``None`` where none sets a limit. Never
    raises.

    Args:
        root: the directory that stands for ``/``, as for :func:`cpu_limit`.
    """
    cgroup = _read(os.path.join(root, "proc/self/cgroup"))
    tightest: tuple[int, int] | None = None
    for directory, _ in _limit_directories(root, cgroup or "", "pids"):
        maximum = (_read(os.path.join(directory, "pids.max")) or "").strip()
        current = (_read(os.path.join(directory, "pids.current")) or "").strip()
        if maximum.isdigit() and current.isdigit():
            found = (int(maximum), int(current))
            if tightest is None or found[0] - found[1] < tightest[0] - tightest[1]:
                tightest = found
    return tightest


@functools.lru_cache(maxsize=16)
def _limit_directories(root: str, cgroup: str, controller: str) -> tuple[tuple[str, int], ...]:
    """``(directory, cgroup version)`` of every cgroup whose ``controller`` limit applies to a process in
    ``cgroup`` (the text of ``/proc/self/cgroup``), deepest first per hierarchy; remembered, as the mounts do
    not move."""
    mountinfo = _read(os.path.join(root, "proc/self/mountinfo"))
    if mountinfo is None:
        return ()
    found: list[tuple[str, int]] = []
    mounts = _mounts(mountinfo)
    for controllers, path in _memberships(cgroup):
        version = 1 if controllers else 2
        if version == 1 and controller not in controllers:
            continue
        for fstype, mount_root, mount_point, options in mounts:
            if (version == 2) != (fstype == "cgroup2") or (version == 1 and controller not in options):
                continue
            found.extend((directory, version) for directory in _directories(mount_root, mount_point, path, root))
            break
    return tuple(found)
