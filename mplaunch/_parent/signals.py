"""The parent's signals during a launch: SIGTERM unwinds it (so workers are stopped first), and SIGINT and
SIGTERM wait while workers are being forked."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class _ParentTerminated(BaseException):
    """Raised in the parent by SIGTERM during a launch, to unwind and stop the workers first."""


@contextlib.contextmanager
def parent_signals() -> Iterator[None]:
    """During the launch, let SIGTERM unwind the parent (so workers are stopped); restore handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        yield
        return

    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked worker that has not yet installed its own handler
            raise SystemExit(128 + signum)
        raise _ParentTerminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _ParentTerminated:
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)
            raise KeyboardInterrupt("SIGTERM received during a launch") from None
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: die by SIGTERM, as asked
        raise KeyboardInterrupt("SIGTERM received during a launch") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for a moment that must not be cut, and deliver them after: while workers fork,
    and while a worker is reaped (a KeyboardInterrupt between multiprocessing's ``waitpid`` and its noting the
    exit code would lose the worker's status for good).

    They are blocked in this thread: a forked child inherits the mask, so a signal sent to it before it has
    installed its own handlers waits instead of unwinding the parent's stack copied into it (the worker
    unblocks them first thing). The kernel may still hand the parent's signal to another thread (a notebook
    kernel's, a timer's), and Python would then run the handler in the main thread at any point, for
    instance inside logging's fork hook, where CPython only prints the KeyboardInterrupt and drops it. So in
    the main thread the Python handlers meanwhile only note what came, and it is raised again, to the real
    handlers, on exit.
    """
    blocked = {signal.SIGINT, signal.SIGTERM}
    noted: list[int] = []
    replaced: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in sorted(blocked):
            handler = signal.getsignal(signum)
            if callable(handler):
                replaced[signum] = handler
                signal.signal(signum, lambda number, frame: noted.append(number))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        for number, handler in replaced.items():
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for number in dict.fromkeys(noted):
            signal.raise_signal(number)
