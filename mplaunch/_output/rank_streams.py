"""Per-rank output in a worker: the parent's pipes (or the caller's own fd 1 and 2) in place of fd 1 and 2, so
that everything is caught (Python streams, logging, C code, children); and the terminal as stdin."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from mplaunch._env import whole_number
from mplaunch._wire.spec import RankFds

RANK_MARK = b"\x00mplaunch:rank="  # an elastic worker's first write, then "rank,pid,node_rank" and a NUL


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


def on_fd(stream: Any, fd: int) -> bool:
    """Return whether ``stream`` is open over descriptor ``fd``."""
    try:
        return not getattr(stream, "closed", False) and bool(stream.fileno() == fd)
    except (AttributeError, OSError, ValueError):
        return False


def _close(*fds: int) -> None:
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)


def _streams_on_fds() -> None:
    """Make ``sys.stdout``/``stderr`` line-buffered over fd 1/2 (a rank killed later loses no printed line)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if isinstance(old, io.TextIOWrapper) and on_fd(old, fd):
            with contextlib.suppress(Exception):
                old.reconfigure(line_buffering=True)
            continue
        new = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        setattr(sys, name, new)
        if getattr(sys, f"__{name}__") is old:
            setattr(sys, f"__{name}__", new)
        _repoint_handlers(old, new)


def _repoint_handlers(old: object, new: TextIO) -> None:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.stream = new


_HELD: list[TextIO] = []  # a forked worker's inherited sys.stdin, from hold_stdin to terminal_stdin


def hold_stdin() -> None:
    """Hide a forked worker's ``sys.stdin`` from multiprocessing, which would open ``/dev/null`` (50 page copies)."""
    if sys.stdin is not None:
        _HELD.append(sys.stdin)
        sys.stdin = None


def stdin_stream() -> TextIO:
    """Open a worker's ``sys.stdin``: the terminal on fd 0 where it is one, else ``/dev/null``; may raise OSError."""
    if os.isatty(0):
        original = sys.__stdin__
        encoding = getattr(original, "encoding", None)
        errors = getattr(original, "errors", None)
        return open(0, encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115
    return open(os.devnull, encoding="utf-8")  # noqa: SIM115


@contextlib.contextmanager
def stdin_for_forks(start_method: str) -> Iterator[TextIO | None]:
    """Yield one :func:`stdin_stream` for all the forked ranks (``None`` unless ``fork``); close it after."""
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
    """Make a worker's ``sys.stdin`` the caller's terminal, if any (``prepared``: one the parent made for forks)."""
    if _HELD:
        inherited = _HELD.pop()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            inherited.close()
        with contextlib.suppress(OSError):
            sys.stdin = prepared if prepared is not None else stdin_stream()
        return
    with contextlib.suppress(OSError, ValueError):
        if os.isatty(0) and not on_fd(sys.stdin, 0):
            sys.stdin, prepared = prepared if prepared is not None else stdin_stream(), None
    if prepared is not None:  # not taken (the caller's sys.stdin is None): its descriptor is let go
        prepared.close()
