"""What steers one launch from outside the code that runs it: one deadline over all its attempts, a request to
stop it (from a future's ``cancel()``, the interpreter's exit, or an interrupted notebook cell), and the worker
failure its supervisor raised last (the one kind of error a restart answers)."""

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
    """Raised in the thread running a launch that was asked to stop; its workers are stopped on the way out.
    A ``BaseException``, so that no ``except Exception`` on the way mistakes it for a failure to restart."""


class LaunchControl:
    """The state one launch shares with whoever may stop it. Thread-safe.

    Attributes:
        deadline: ``time.monotonic()`` by which every attempt must be done, or ``None``; set when the first
            attempt starts waiting for its workers.
        failure: the worker failure the supervisor raised last, or ``None``.
        state: the parent's :class:`~mplaunch.GlobalState`, captured when the launch was submitted, or ``None``
            to capture it when the launch starts.
        in_process: the call runs the function in this process (already under a launcher): it cannot be stopped.
        queued: the launch waits for its devices (``devices=``): its future is not running yet.
        stacks_source: while workers run, the function that collects their stacks (the supervisor's), else
            ``None``.
        stacks_wanted: someone may ask for the workers' stacks at any time (a future's ``stacks()``), so
            they install their dump handler even without a ``timeout`` or ``stall_timeout``.
        restarts: the number of the attempt under way (0: the first).
        ranks: the :class:`~mplaunch.RankReport` of each rank of the last attempt that started workers.
        report: the launch's :class:`~mplaunch.RunReport`, once it has ended.
        preemption: the launch's preemption notice while it runs (see :mod:`mplaunch._parent.preemption`).
    """

    def __init__(self, *, stoppable: bool = False) -> None:
        self.deadline: float | None = None
        self.failure: BaseException | None = None
        self.state: GlobalState | None = None
        self.in_process = False
        self.queued = False
        self.stacks_source: Callable[[], dict[int, str]] | None = None
        self.stacks_wanted = False
        self.restarts = 0
        self.ranks: tuple[RankReport, ...] = ()
        self.report: RunReport | None = None
        self.preemption: Preemption | None = None
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
        """A file descriptor that becomes readable when a stop is requested (for ``connection.wait``)."""
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
        """Hand the launch's preemption notice to whoever may preempt it (or ``None`` once it ends); the
        ``future.preempt()`` calls made before reach it now."""
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
