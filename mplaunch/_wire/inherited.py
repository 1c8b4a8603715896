"""Descriptors that travel to a worker as it starts, and the anonymous memory files results and arguments
are written to."""

from __future__ import annotations

import multiprocessing.context
import os
from typing import Any

from mplaunch._platform import forks


class InheritedFd:
    """A descriptor that reaches the worker under every start method.

    Under fork the number is inherited as it is. Under spawn and forkserver, pickling it (which happens while
    the process starts) registers it with multiprocessing's ``reduction.DupFd``, as ``Connection`` objects do,
    and the worker gets its own copy.
    """

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


#: The start of the name of every memory file mplaunch makes.
PREFIX = "mplaunch-"
#: The descriptors of memory files made or received in this process that may still be open: where
#: :func:`close_memory_files` looks, instead of listing every descriptor of the process.
_MADE: set[int] = set()
#: Held while a memory file is made and noted (``memfd_create`` lets other threads run): whoever forks
#: workers holds it too, so a worker never inherits a memory file that is not noted yet.
MAKING = forks.new_lock()


def memory_file(name: str) -> int | None:
    """A new anonymous memory file (Linux's ``memfd_create``, close-on-exec), or ``None`` where there is none
    (another system, a kernel before 3.17, a seccomp filter that refuses it).

    Its pages are shared memory that no file system's size limit counts: a container's small ``/dev/shm``
    (Docker's 64 MiB) does not bound what travels through it. It lives while a descriptor or a mapping of it
    does, and no name of it is left anywhere when the last goes.

    Args:
        name: shown in ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` (as ``/memfd:mplaunch-<name>``).
    """
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
    """Close every descriptor of a memory file of mplaunch's in this process but those in ``keep``: a forked
    worker inherits those of every launch its parent runs at the time (``submit()``), and would hold their
    memory until it exits. A noted number that now names something else (closed elsewhere, then reused) is
    left open."""
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
            try:
                os.close(fd)
            except OSError:
                pass
