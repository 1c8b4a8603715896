"""The CPU and pids limits of this process's cgroups (Docker ``--cpus``, Kubernetes limits, systemd), from
``/proc/self/cgroup`` and ``/proc/self/mountinfo``; ``os.sched_getaffinity`` and psutil ignore them.

A cgroup's limit bounds every cgroup below it, so the smallest along the process's cgroup path up to each
mount's root applies (joblib/loky read only the fixed top-level paths, which miss nested cgroups)."""

from __future__ import annotations

import functools
import os
import re

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _read(path: str) -> str | None:
    """Return the text of ``path``, or ``None`` (plain system calls: a text file object costs more)."""
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
    """Return ``(fstype, root, mount point, super options)`` of every cgroup file system in ``mountinfo``."""
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
    """Return ``(controllers, path)`` of each line of ``/proc/self/cgroup`` (v2 lists no controllers)."""
    found = []
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.append((set(parts[1].split(",")) - {""}, parts[2]))
    return found


def _quota(directory: str, version: int) -> float | None:
    """Return the CPUs one cgroup directory's own limit allows, or ``None`` for none."""
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
    """List the cgroup directories from ``path`` up to the mount point, deepest first."""
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
    """Return the CPUs this process's cgroups allow (e.g. ``1.5``) or ``None``, read each call; ``root``: for tests."""
    cgroup = _read(os.path.join(root, "proc/self/cgroup"))
    limits = [
        quota
        for directory, version in _limit_directories(root, cgroup or "", "cpu")
        if (quota := _quota(directory, version)) is not None
    ]
    return min(limits) if limits else None


def pids_limit(root: str = "/") -> tuple[int, int] | None:
    """Return ``(pids.max, pids.current)`` of the cgroup on this process's path with the least room, or ``None``."""
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
    """Return ``(directory, version)`` of each cgroup whose ``controller`` limit applies, deepest first (cached)."""
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
