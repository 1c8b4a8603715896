"""Descriptors that travel to a worker as it starts, and the memory files results and arguments go to."""

from __future__ import annotations

import contextlib
import multiprocessing.context
import os
from typing import Any

from mplaunch._platform import forks


class InheritedFd:
    """A descriptor for a worker: fork inherits the number, spawn/forkserver get a ``DupFd`` (as ``Connection``)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        if multiprocessing.context.get_spawning_popen() is None:
            raise TypeError("an InheritedFd is only sent to a process being started")
        return _rebuild, (reduction.DupFd(self.fd),)


def _rebuild(dup: Any) -> InheritedFd:
    fd = dup.detach()
    _MADE.add(fd)  # a memory file or not: close_memory_files looks before it closes
    return InheritedFd(fd)


PREFIX = "mplaunch-"
_MADE: set[int] = set()  # memory files made or received here that may be open: close_memory_files looks here
# Held while a memory file is made and noted (memfd_create releases the GIL); whoever forks workers holds it
# too, so a worker never inherits a memory file not noted yet.
MAKING = forks.new_lock()


def memory_file(name: str) -> int | None:
    """Return a new close-on-exec ``memfd_create`` file, or ``None``: no ``/dev/shm`` limit counts it."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    with MAKING:
        try:
            fd = int(create(PREFIX + name, os.MFD_CLOEXEC))
        except OSError:
            return None
        _MADE.add(fd)
    return fd


def close_memory_files(keep: set[int]) -> None:
    """Close this process's memory files (a forked worker inherits every launch's) but those in ``keep``."""
    for fd in [fd for fd in _MADE if fd not in keep]:
        _MADE.discard(fd)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{PREFIX}"):
            close_quietly(fd)


def close_quietly(*fds: int | None) -> None:
    """Close each descriptor that is not ``None``, ignoring one already closed."""
    for fd in fds:
        if fd is not None:
            _MADE.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
