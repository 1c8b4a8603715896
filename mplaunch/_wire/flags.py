"""The preemption flag: one byte in the launch directory that the parent and every worker map, so a worker learns
of a preemption without a signal (which would interrupt its DataLoader and collectives) or a system call."""

from __future__ import annotations

import contextlib
import mmap
import os

FLAG = "preempted.flag"
FLAG_VARIABLE = "MPLAUNCH_PREEMPT_FILE"

_mapping: mmap.mmap | None = None  # this worker's mapping of its launch's flag
_looked = False  # FLAG_VARIABLE was already tried


def _map(path: str, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.pwrite(fd, b"\0", 0)  # (a flag warm ranks have mapped is cleared in place, never truncated)
        return mmap.mmap(fd, 1, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file's memory


def create(directory: str) -> mmap.mmap:
    """Create (or clear, for warm workers' next call) the flag in ``directory``; return its mapping."""
    return _map(os.path.join(directory, FLAG), create=True)


def attach(directory: str, present: bool | None = None) -> bool:
    """Map ``directory``'s flag in a worker, set ``MPLAUNCH_PREEMPT_FILE``; return whether there is one."""
    global _mapping, _looked
    _looked = True
    if present is False:
        _mapping = None
        return False
    path = os.path.join(directory, FLAG)
    try:
        _mapping = _map(path, create=False)
    except OSError:
        _mapping = None
        os.environ.pop(FLAG_VARIABLE, None)
        return False
    if os.environ.get(FLAG_VARIABLE) != path:
        os.environ[FLAG_VARIABLE] = path
    return True


def path_if_present(directory: str) -> str | None:
    """Return the path of ``directory``'s flag, if it has one."""
    path = os.path.join(directory, FLAG)
    return path if os.path.exists(path) else None


def is_set() -> bool:
    """Return whether this process's launch was preempted (mapping ``MPLAUNCH_PREEMPT_FILE`` on first call)."""
    global _looked, _mapping
    if _mapping is None and not _looked:
        _looked = True
        path = os.environ.get(FLAG_VARIABLE)
        if path:
            with contextlib.suppress(OSError, ValueError):
                _mapping = _map(path, create=False)
    return _mapping is not None and _mapping[0] != 0


def raise_flag(mapping: mmap.mmap) -> None:
    """Set the flag; every worker's next :func:`is_set` returns ``True``."""
    mapping[0] = 1
