"""Every live rank's Python stacks, on request (each worker dumps them with :mod:`faulthandler` on
:data:`~mplaunch._wire.board.STACKS_SIGNAL`), and where each rank was, in one line: the innermost frame of the
user's code in the thread that runs the function. Dumping every thread from a signal handler is CPython's
``faulthandler`` idea (``py-spy dump`` does it from outside)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sysconfig
import time
from collections.abc import Callable, Mapping

import torch

from mplaunch._wire.board import stacks_name, stacks_pending_name

#: Seconds the parent waits for the dumps (all ranks together): stacks never delay a stop by more.
DUMP_BOUND = 1.0
_POLL = 0.01  # seconds between looks at the dump files
_STEADY = 3  # looks without growth after which a dump is complete

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.*)$')
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mplaunch/
#: The worker's frames that call the user's function: a launch's rank, a warm call, a multi-node rank.
_RUNS_FUNCTION = {
    (os.path.join(_PACKAGE, "_worker", "entry.py"), "execute"),
    (os.path.join(_PACKAGE, "_worker", "serve.py"), "_serve_call"),
    (os.path.join(_PACKAGE, "_worker", "elastic.py"), "elastic_entry"),
}
#: Where a forked worker's stack meets its parent's: mplaunch's forking function (file, function).
_FORKING = (os.path.join(_PACKAGE, "_parent", "processes.py"), "_fork_all")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_LIBRARIES = ("site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame line of a dump."""

    file: str
    line: int | None
    function: str

    def __str__(self) -> str:
        file = os.path.relpath(self.file) if os.path.isabs(self.file) else self.file
        if file.startswith(".."):
            file = self.file
        return f"{self.function} ({file}:{self.line if self.line is not None else '?'})"


def collect(directory: str, senders: Mapping[int, Callable[[], None]], bound: float = DUMP_BOUND) -> dict[int, str]:
    """Signal each rank through ``senders`` and return, by rank, the dumps written within ``bound`` seconds in all."""
    paths: dict[int, str] = {}
    for rank, send in senders.items():
        path = os.path.join(directory, stacks_name(rank))
        try:
            os.truncate(path, 0)  # the worker appends: its next dump starts the file
            send()
        except OSError:  # no dump file yet (the rank is starting: the signal would end it), or it has ended
            continue
        paths[rank] = path
    sizes, steady = dict.fromkeys(paths, 0), dict.fromkeys(paths, 0)
    deadline = time.monotonic() + bound
    while any(count < _STEADY for count in steady.values()) and time.monotonic() < deadline:
        time.sleep(_POLL)
        for rank in paths:
            with contextlib.suppress(OSError):
                size = os.path.getsize(paths[rank])
                steady[rank] = steady[rank] + 1 if size and size == sizes[rank] else 0
                sizes[rank] = size
    found = {}
    for rank, path in paths.items():
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
            if text:
                found[rank] = above_the_fork(text)
    return found


def above_the_fork(text: str) -> str:
    """Drop from a forked worker's dump the frames it inherited, from mplaunch's forking function down."""
    kept: list[str] = []
    inherited = False
    for line in text.splitlines(keepends=True):
        if _THREAD.match(line) or line.startswith("Stack (most recent call first)"):
            inherited = False
        elif (match := _FRAME.match(line)) is not None and (match["file"], match["function"]) == _FORKING:
            inherited = True
        if not inherited:
            kept.append(line)
    return "".join(kept)


def forget(directory: str, rank: int) -> None:
    """Remove an earlier attempt's dump files of ``rank``: a signal before the new worker makes its own ends it."""
    for name in (stacks_name(rank), stacks_pending_name(rank)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def threads(text: str) -> list[list[Frame]]:
    """Parse a faulthandler dump into each thread's frames, innermost first."""
    found: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line) or line.startswith("Stack (most recent call first)"):
            found.append([])
        elif (match := _FRAME.match(line)) is not None:
            if not found:
                found.append([])
            number = match["line"]
            found[-1].append(Frame(match["file"], int(number) if number.isdigit() else None, match["function"]))
    return found


def _tier(file: str) -> int:
    """Rank ``file``: 0 the user's (also ``<stdin>``, ``<string>``), 1 another library, 2 mplaunch, torch, stdlib."""
    if file.startswith("<frozen ") or file.startswith(_PACKAGE + os.sep) or file.startswith(_TORCH + os.sep):
        return 2
    if any(f"{os.sep}{name}{os.sep}" in file for name in _LIBRARIES):
        return 1
    paths = sysconfig.get_paths()
    stdlib = {os.path.abspath(paths[key]) for key in ("stdlib", "platstdlib") if key in paths}
    return 2 if any(file.startswith(path + os.sep) for path in stdlib) else 0


def innermost_user_frame(text: str) -> Frame | None:
    """Return the innermost frame of the user's code (else a library's, else any) in the thread running the function."""
    stacks = [stack for stack in threads(text) if stack]
    if not stacks:
        return None
    stack = next((s for s in stacks if any(_runs_function(f) for f in s)), stacks[0])
    entry = next((i for i, f in enumerate(stack) if _runs_function(f)), len(stack) - 1)
    stack = stack[: entry + 1]  # below the entry: the parent's frames a forked worker inherited (never where it is)
    for tier in (0, 1):
        frame = next((f for f in stack if _tier(f.file) == tier), None)
        if frame is not None:
            return frame
    return stack[0]


def _runs_function(frame: Frame) -> bool:
    """Tell whether ``frame`` is the worker entry's frame that calls the user's function."""
    return (frame.file, frame.function) in _RUNS_FUNCTION


def summary(stacks: Mapping[int, str]) -> str:
    """Summarise one clause per rank, e.g. ``rank 0 in stuck_here (train.py:12)``, or ``outside your code``."""
    parts = []
    for rank in sorted(stacks):
        frame = innermost_user_frame(stacks[rank])
        if frame is None:
            parts.append(f"rank {rank}: no Python frame")
        elif _tier(frame.file) == 2:
            parts.append(f"rank {rank} outside your code, in {frame}")
        else:
            parts.append(f"rank {rank} in {frame}")
    return "; ".join(parts)


def write_to_log_dir(log_dir: str | None, stacks: Mapping[int, str]) -> None:
    """Write each rank's dump to ``log_dir/rank{N}.stacks``; never raises."""
    if log_dir is None:
        return
    for rank, text in stacks.items():
        with contextlib.suppress(OSError), open(os.path.join(log_dir, f"rank{rank}.stacks"), "w") as file:
            file.write(text)
