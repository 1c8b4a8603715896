"""A process's tree on Linux: its children and all their descendants, read from ``/proc``, and the flag that
keeps orphaned descendants in the tree (``PR_SET_CHILD_SUBREAPER``). Elsewhere, every answer is empty."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from typing import Any

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def children_of(pid: int) -> list[int]:
    """Return the children of ``pid`` (``/proc/<pid>/task/*/children``), in no order; ``[]`` if unknown."""
    if not _has_children_files():
        return _children_by_scan(pid)
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{task}/children") as file:
            found.extend(int(child) for child in file.read().split())
    return found


def descendants(pid: int) -> list[int]:
    """Return every descendant of ``pid``, parents first; one forked meanwhile may be missed (read again)."""
    found: list[int] = []
    seen = {pid}
    queue = [pid]
    while queue:
        for child in children_of(queue.pop(0)):
            if child not in seen:
                seen.add(child)
                found.append(child)
                queue.append(child)
    return found


def takes_signal(pid: int, signum: int, unblocked: bool = False) -> bool:
    """Whether ``pid`` catches or ignores ``signum`` (and does not block it, if ``unblocked``); ``True`` if unknown."""
    with contextlib.suppress(OSError, ValueError, KeyError), open(f"/proc/{pid}/status") as file:
        fields = dict(line.split(":", 1) for line in file)
        blocked = unblocked and int(fields["SigBlk"], 16) >> (signum - 1) & 1
        return bool((int(fields["SigCgt"], 16) | int(fields["SigIgn"], 16)) >> (signum - 1) & 1) and not blocked
    return True


def with_environment(entries: dict[str, str]) -> list[int]:
    """Return this user's other processes whose exec-time environment (``/proc/<pid>/environ``) holds every
    item of ``entries``."""
    wanted = {f"{name}={value}".encode() for name, value in entries.items()}
    found: list[int] = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as file:
                if wanted <= set(file.read().split(b"\0")):
                    found.append(int(entry))
    return found


def running(pid: int) -> bool:
    """Return whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux 3.4+), so orphaned descendants stay in its tree; return
    whether the flag is set."""
    return _PRCTL is not None and _PRCTL(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` when the thread that forked this process ends (``PR_SET_PDEATHSIG``, as
    ``torch.multiprocessing.spawn`` does); return whether it took it."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # found once, on import: a forked worker finding it itself would pay a quarter millisecond


@functools.lru_cache(maxsize=1)
def _has_children_files() -> bool:
    """Return whether the kernel lists children in ``/proc`` (``CONFIG_PROC_CHILDREN``)."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _children_by_scan(pid: int) -> list[int]:
    """Find the children of ``pid`` by reading every process's parent in ``/proc/*/stat``."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as file:
                if int(file.read().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry))
    return found
