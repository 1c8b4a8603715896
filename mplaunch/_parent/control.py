"""What steers one launch from outside the code that runs it: one deadline over all its attempts, a stop request
(a future's ``cancel()``, the interpreter's exit, an interrupted cell), and the worker failure it raised last."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mplaunch._state.snapshot import GlobalState

if TYPE_CHECKING:
    from mplaunch._parent.preemption import Preemption
    from mplaunch._reports import RankReport, RunReport


class LaunchStopped(BaseException):
    """Raised in the thread of a launch asked to stop; a ``BaseException``, so no restart mistakes it for a failure."""


class LaunchControl:
    """The state one launch shares with whoever may stop it. Thread-safe."""

    def __init__(self, *, stoppable: bool = False) -> None:
        self.deadline: float | None = None  # by which every attempt must be done; set as the first one starts
        self.failure: BaseException | None = None  # the worker failure raised last
        self.state: GlobalState | None = None  # captured at submit(), else when the launch starts
        self.in_process = False  # it runs the function here (under an outer launcher): it cannot be stopped
        self.queued = False  # it waits for its devices: its future is not running yet
        self.stacks_source: Callable[[], dict[int, str]] | None = None  # while workers run: collects their stacks
        self.stacks_wanted = False  # a future's stacks() may ask at any time: workers install their dump handler
        self.restarts = 0  # the attempt under way (0: the first)
        self.ranks: tuple[RankReport, ...] = ()  # the report of each rank of the last attempt that started
        self.report: RunReport | None = None  # the launch's, once it has ended
        self.preemption: Preemption | None = None  # its notice while it runs
        self._preempt_calls = 0  # future.preempt() calls, also those made before the launch had its notice
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pipe = os.pipe() if stoppable else None

    def start_clock(self, timeout: float | None) -> None:
        """Start the deadline of ``timeout`` seconds, unless an earlier attempt started it."""
        if self.deadline is None and timeout is not None:
            self.deadline = time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left before the deadline (``0.0`` once passed), or ``None`` without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def fileno(self) -> int | None:
        """Return a descriptor that becomes readable when a stop is requested, or ``None``."""
        return None if self._pipe is None else self._pipe[0]

    def request_stop(self) -> None:
        """Ask the launch to stop its workers and end with :class:`LaunchStopped`; returns at once."""
        with self._lock:
            self._stop.set()
            if self._pipe is not None:
                os.write(self._pipe[1], b"x")

    def preempt(self) -> None:
        """Notify the launch's preemption (``future.preempt()``): now if it runs, else as soon as it starts."""
        with self._lock:
            self._preempt_calls += 1
            preemption = self.preemption
        if preemption is not None:
            preemption.notify(None)

    def set_preemption(self, preemption: Preemption | None) -> None:
        """Hand over the launch's notice (``None`` once it ends); earlier ``future.preempt()`` calls reach it now."""
        with self._lock:
            self.preemption = preemption
            calls = self._preempt_calls
        for _ in range(min(calls, 2) if preemption is not None else 0):
            preemption.notify(None)  # type: ignore[union-attr]

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def check(self) -> None:
        """Raise :class:`LaunchStopped` if a stop was requested."""
        if self._stop.is_set():
            raise LaunchStopped()

    def close(self) -> None:
        """Close the pipe; a later :meth:`request_stop` only sets the flag."""
        with self._lock:
            if self._pipe is not None:
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None
