"""The parent's signals during a launch: SIGTERM unwinds it (so workers are stopped first), and SIGINT and
SIGTERM wait while workers are being forked."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType


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
def signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM while workers start. A forked child inherits the mask, so a signal sent to it
    before it has installed its own handlers waits instead of unwinding the parent's stack copied into it;
    the worker unblocks them first thing. Signals sent to the parent meanwhile are delivered on exit."""
    blocked = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
