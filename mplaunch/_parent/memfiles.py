"""Where a launch's payload and outcomes are written: memory files (``memfd_create``: no file system's size
bounds them) that the parent makes before the workers start, so it holds every descriptor and no worker has to
outlive its outcome (as CPython's ``multiprocessing.heap`` arenas do); else files in the launch directory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from mplaunch._errors import LaunchRefusedError
from mplaunch._parent import checks
from mplaunch._parent.directory import space_hint
from mplaunch._wire import transport
from mplaunch._wire.importable import WorkerImports
from mplaunch._wire.inherited import InheritedFd, close_quietly, memory_file
from mplaunch._wire.records import PAYLOAD, Payload


@contextlib.contextmanager
def outcome_files(nprocs: int) -> Iterator[tuple[InheritedFd, ...] | None]:
    """Yield one memory file per rank for its outcome (``None`` where there are none), and close them after."""
    fds: list[int] = []
    try:
        for rank in range(nprocs):
            fd = memory_file(f"rank{rank}")
            if fd is None:
                close_quietly(*fds)
                fds = []
                yield None
                return
            fds.append(fd)
        yield tuple(map(InheritedFd, fds))
    finally:
        close_quietly(*fds)


@dataclasses.dataclass(frozen=True)
class Written:
    """Where a payload was written (``fd=None``: the launch directory), and what travels with each start instead."""

    fd: InheritedFd | None = None
    start_objects: tuple[Any, ...] = ()


@contextlib.contextmanager
def payload_written(
    payload: Payload,
    directory: str,
    start_method: str,
    imports: WorkerImports | None,
    *,
    memory: bool,
    keep_shared: bool = False,
) -> Iterator[Written]:
    """Write the call for workers that cannot inherit it; yield where, and the objects that travel with each start."""
    fd = memory_file("payload") if memory else None
    try:
        try:
            if fd is None:
                found = transport.dump(
                    payload, directory, PAYLOAD, imports=imports, start_objects=True, keep_shared=keep_shared
                )
            else:
                found = transport.dump_fd(payload, fd, imports=imports, start_objects=True, keep_shared=keep_shared)
        except OSError as error:
            where = os.path.dirname(directory) if fd is None else "memory"
            raise LaunchRefusedError(
                f"cannot write the call's arguments to {where}: {error}. "
                f"{space_hint(directory) if fd is None else 'Free memory, or pass smaller arguments.'}"
            ) from error
        except Exception as error:
            culprit = checks.describe_unpicklable(payload.args, payload.kwargs, imports, payload.function)
            raise LaunchRefusedError(
                f"cannot send the call to {start_method!r} workers: {culprit}. Under 'spawn' and 'forkserver' "
                "every argument is pickled; pass picklable values, create the object inside the function, or use "
                "start_method='fork'."
            ) from error
        if start_method != "fork":  # forked workers inherit them: nothing is pickled
            checks.check_start_objects(found, start_method)
        yield Written(None if fd is None else InheritedFd(fd), tuple(found))
    finally:
        close_quietly(fd)
