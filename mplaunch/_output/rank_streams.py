"""Per-rank output in a worker: put the descriptors the parent chose in place of fd 1 and fd 2; and the
caller's terminal as the worker's standard input.

The parent (:mod:`mplaunch._output.pump`) hands every worker a table of descriptors, one pair per local rank: the
write ends of pipes it drains (for ``prefix_output``, ``console_ranks``, ``log_dir``, or a parent whose
``sys.stdout`` is not fd 1, e.g. a Jupyter kernel), or the caller's own fd 1 and fd 2 (forkserver workers,
which would otherwise write to the fork server's). Because the worker's descriptors themselves change,
everything written to them is caught: Python streams, logging handlers made before the launch, C code,
child processes, faulthandler.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from mplaunch._env import whole_number
from mplaunch._wire.spec import RankFds

#: Written by an elastic worker on its pipes before anything else, followed by ``rank,pid,node_rank`` and a NUL,
#: so the parent learns the global rank, the pid and the node of what follows.
RANK_MARK = b"\x00mplaunch:rank="


def take_fds(table: tuple[RankFds, ...] | None, local_rank: int, rank: int) -> None:
    """In a worker: put this rank's descriptors in place of fd 1 and 2 and close the other ranks' copies."""
    if table is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()  # what is buffered was meant for the old descriptors
    mine = table[local_rank]
    keep = {mine.stdout.fd, mine.stderr.fd}
    _close(*(fd for entry in table for fd in (entry.stdout.fd, entry.stderr.fd) if fd not in keep))
    for fd, target in ((mine.stdout.fd, 1), (mine.stderr.fd, 2)):
        if mine.announce:
            node_rank = whole_number(os.environ.get("GROUP_RANK", "0")) or 0
            os.write(fd, RANK_MARK + f"{rank},{os.getpid()},{node_rank}\x00".encode())
        if fd != target:
            os.dup2(fd, target)
    _close(mine.stdout.fd, mine.stderr.fd)
    if mine.routed:
        _streams_on_fds()


def _close(*fds: int) -> None:
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)


def _streams_on_fds() -> None:
    """Make ``sys.stdout``/``sys.stderr`` write to fd 1/2, line-buffered, so that a line reaches the parent
    when it ends (a rank killed right after loses nothing it printed).

    A stream that is not over its descriptor (ipykernel's ``OutStream`` in a forked worker) is replaced by one
    that is, and logging handlers holding the old stream (made before the launch) are pointed at the new one.
    """
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if _writes_to(old, fd):
            with contextlib.suppress(Exception):
                old.reconfigure(line_buffering=True)
            continue
        new = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        setattr(sys, name, new)
        if getattr(sys, f"__{name}__") is old:
            setattr(sys, f"__{name}__", new)
        _repoint_handlers(old, new)


def _writes_to(stream: TextIO | None, fd: int) -> bool:
    """Whether ``stream`` is a plain text stream over descriptor ``fd``."""
    if not isinstance(stream, io.TextIOWrapper):
        return False
    try:
        return stream.fileno() == fd
    except (OSError, ValueError):
        return False


def _repoint_handlers(old: object, new: TextIO) -> None:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.stream = new


#: In a worker that mplaunch forked: the ``sys.stdin`` it inherited, held from multiprocessing's start-up
#: (see :func:`hold_stdin`) until :func:`terminal_stdin` closes it.
_HELD: list[TextIO] = []


def hold_stdin() -> None:
    """In a worker that mplaunch forked, before multiprocessing's start-up runs there: hold the inherited
    ``sys.stdin`` back from it. Multiprocessing would close it and open ``/dev/null`` in its place (some 50
    page copies in a forked worker: a new file object allocates from the heap it shares with the parent),
    and :func:`terminal_stdin` would often replace that again; it then does both at once."""
    if sys.stdin is not None:
        _HELD.append(sys.stdin)
        sys.stdin = None


def stdin_stream() -> TextIO:
    """A new reader for a worker's ``sys.stdin``: the caller's terminal on fd 0 where fd 0 is one (the
    encoding of the process's original stdin), else ``/dev/null``, as multiprocessing gives its children.

    Raises:
        OSError: ``/dev/null`` cannot be opened (the open-files limit).
    """
    if os.isatty(0):
        original = sys.__stdin__
        encoding = getattr(original, "encoding", None)
        errors = getattr(original, "errors", None)
        return open(0, encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115
    return open(os.devnull, encoding="utf-8")  # noqa: SIM115


@contextlib.contextmanager
def stdin_for_forks(start_method: str) -> Iterator[TextIO | None]:
    """In the parent, around the forks of a launch's ranks: under ``fork``, one :func:`stdin_stream` for
    every rank to take as its ``sys.stdin`` (closed here afterwards; each rank has its copy), so that no rank
    makes its own; ``None`` under the other start methods, or when it cannot be opened."""
    stream = None
    if start_method == "fork":
        with contextlib.suppress(OSError):
            stream = stdin_stream()
    try:
        yield stream
    finally:
        if stream is not None:
            stream.close()


def terminal_stdin(prepared: TextIO | None = None) -> None:
    """In a worker: make ``sys.stdin`` the caller's terminal (``input()``, pdb) where multiprocessing made it
    ``/dev/null``; a standard input that is no terminal (a pipe, a file) stays the caller's alone.

    In a worker that mplaunch forked (:func:`hold_stdin`), the inherited stream is closed, as multiprocessing
    closes it, and ``sys.stdin`` becomes ``prepared`` (a :func:`stdin_stream` the parent made before the
    fork), else a new :func:`stdin_stream`.
    """
    if _HELD:
        inherited = _HELD.pop()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            inherited.close()
        with contextlib.suppress(OSError):
            sys.stdin = prepared if prepared is not None else stdin_stream()
        return
    with contextlib.suppress(OSError, ValueError):
        if os.isatty(0) and not _reads_fd0(sys.stdin):
            sys.stdin, prepared = prepared if prepared is not None else stdin_stream(), None
    if prepared is not None:  # not taken (the caller's sys.stdin is None): its descriptor is let go
        prepared.close()


def _reads_fd0(stream: object) -> bool:
    try:
        return not stream.closed and stream.fileno() == 0  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
