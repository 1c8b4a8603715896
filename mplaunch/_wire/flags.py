"""The preemption flag of a launch: one byte in a file of the launch directory, mapped into the parent and every
worker, so that a worker learns of a preemption without a signal (a signal would interrupt its DataLoader and
collectives) and reads it without a system call.

The parent creates the file and sets the byte when it receives one of ``preempt_signals``; each worker maps it
when it starts. Processes a worker forks (DataLoader workers) share the mapping; others a worker starts find
the file through ``MPLAUNCH_PREEMPT_FILE`` and map it on their first read.
"""

from __future__ import annotations

import contextlib
import mmap
import os

#: Name of the flag file in the launch directory.
FLAG = "preempted.flag"
#: Set in workers to the flag file's path, for processes they start that do not inherit the mapping.
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
    """In the parent: create the flag in ``directory``, or clear the one there (warm workers' next call), and
    return its mapping (closed by the caller)."""
    return _map(os.path.join(directory, FLAG), create=True)


def attach(directory: str, present: bool | None = None) -> bool:
    """In a worker: map ``directory``'s flag if the launch has one; return whether it has. Sets
    ``MPLAUNCH_PREEMPT_FILE`` for the processes the worker starts (unless it has that value already).
    ``present``: whether the launch has a flag, as the parent knew before it forked this worker (and left
    ``MPLAUNCH_PREEMPT_FILE`` out of its environment when not); ``None``: look."""
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
    """In the parent: the path of ``directory``'s flag, if the launch has one (for :func:`attach`)."""
    path = os.path.join(directory, FLAG)
    return path if os.path.exists(path) else None


def is_set() -> bool:
    """Whether this process's launch was preempted: one read of shared memory (the first call in a process
    that did not inherit the mapping opens the file named by ``MPLAUNCH_PREEMPT_FILE``)."""
    global _looked, _mapping
    if _mapping is None:
        if _looked:
            return False
        _looked = True
        path = os.environ.get(FLAG_VARIABLE)
        if not path:
            return False
        with contextlib.suppress(OSError, ValueError):
            _mapping = _map(path, create=False)
        if _mapping is None:
            return False
    return _mapping[0] != 0


def raise_flag(mapping: mmap.mmap) -> None:
    """In the parent: set the flag; every worker's next :func:`is_set` returns ``True``."""
    mapping[0] = 1
