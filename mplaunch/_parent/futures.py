"""Launches that run in the background (``fn.submit(...)``), each in a daemon thread that settles its future.
:meth:`LaunchFuture.cancel` wakes the launch's loop through a pipe, then waits until the workers are gone. Running
launches are stopped at exit (``atexit``, before ``multiprocessing`` joins the workers) and by Ctrl-C while
waiting for one (a notebook cell's interrupt); if the process dies, ``PR_SET_PDEATHSIG`` ends the workers."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from mplaunch._errors import raised_by_design
from mplaunch._frames import Caller, outside_caller, warnings_for
from mplaunch._parent.control import LaunchControl, LaunchStopped
from mplaunch._parent.stream import Queued, Stream
from mplaunch._platform import forks

if TYPE_CHECKING:
    from mplaunch._reports import RunReport

T = TypeVar("T")

_lock = forks.new_lock()
_running: set[LaunchFuture[Any]] = set()
_streams: weakref.WeakKeyDictionary[Stream[Any], LaunchControl] = weakref.WeakKeyDictionary()  # calls' streams
_hooks_installed = False


@forks.in_child
def _forget_running() -> None:
    """Forget the parent's launches in a forked child, whose exit must not stop them through the shared pipes."""
    _running.clear()
    _streams.clear()


class LaunchFuture(Future[T]):
    """The future of a submitted launch; [`cancel()`][mplaunch.LaunchFuture.cancel] also stops a launch that is running.

    The future stays ``PENDING`` (as ``concurrent.futures`` counts states) until the launch has ended, so that
    a stopped launch can still end ``CANCELLED``; [`running()`][mplaunch.LaunchFuture.running] says whether its
    launch is under way.
    """

    def __init__(self, control: LaunchControl) -> None:
        super().__init__()
        self._control = control
        self._pid = os.getpid()  # the process whose thread runs the launch
        self._thread: threading.Thread | None = None
        self._settle_lock = threading.Lock()

    def stacks(self) -> dict[int, str]:
        """Return every running rank's Python stacks (all threads), by rank; the workers keep running.

        Each worker writes them with ``faulthandler`` on a real-time signal (never SIGUSR1/SIGUSR2, which
        are the user's), also while it is blocked in C code or a collective. Takes at most about a second.

        Returns:
            Each rank's stacks as text, by rank; empty when no worker runs (the launch has not started its
            workers yet, or has ended, or runs in this process). A rank still starting, or that does not
            dump within the second, is missing.

        Raises:
            RuntimeError: the launch has not ended and this process was forked from the one that runs it.
        """
        self._check_process()
        source = self._control.stacks_source
        return {} if source is None else source()

    @property
    def report(self) -> RunReport | None:
        """The launch's [`RunReport`][mplaunch.RunReport] once it has ended (each rank's exit, peak memory, CPU and
        wall time), else ``None``."""
        return self._control.report

    def running(self) -> bool:
        """Return whether the launch is under way (starting, running its workers, or stopping them); a launch
        waiting for its devices (``devices=``) is not."""
        thread = self._thread
        return not self.done() and not self._control.queued and thread is not None and thread.is_alive()

    def cancel(self) -> bool:
        """Stop the launch: its workers get SIGTERM, then SIGKILL after ``grace_period`` seconds.

        Blocks until every worker has been stopped and reaped and the launch directory removed. Returns ``True`` when
        the future ends cancelled (``result()`` then raises ``CancelledError``); ``False`` when the launch had already
        finished, or runs the function in this process (under an outer launcher), which cannot be stopped.

        Raises:
            RuntimeError: the launch has not ended and this process was forked from the one that runs it (a
                stop from there would reach the parent's ranks, and its future would never settle).
        """
        if self.done():
            return self.cancelled()
        if self._control.in_process:
            return False
        self._check_process()
        self._control.request_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._settle_lock:
            if self.done():
                return self.cancelled()
            super().cancel()
            self.set_running_or_notify_cancel()  # wakes concurrent.futures.wait() and as_completed()
            return True

    def preempt(self) -> bool:
        """Preempt the launch, as one of ``preempt_signals`` preempts a call: every rank's ``mplaunch.preempted()``
        becomes true, the ranks get ``preempt_grace`` seconds to save and return, the rest are stopped, and ``result()``
        raises [`PreemptedError`][mplaunch.PreemptedError]. A second call ends the grace at once. Returns at once.

        A submitted launch runs in a thread, and Python runs signal handlers only in the main thread, so
        ``preempt_signals`` are not handled for it: call this from your own handler, e.g.
        ``signal.signal(signal.SIGTERM, lambda *_: future.preempt())``.

        Returns:
            ``True`` when the launch is told (now, or as soon as it starts); ``False`` when it has finished or
            runs in this process (under an outer launcher), which cannot be preempted.

        Raises:
            RuntimeError: the launch has not ended and this process was forked from the one that runs it.
        """
        if self.done() or self._control.in_process:
            return False
        self._check_process()
        self._control.preempt()
        return True

    def result(self, timeout: float | None = None) -> T:
        """Wait for the launch and return its result, or raise what the call would raise; Ctrl-C while
        waiting stops the launch (as it stops a call) before ``KeyboardInterrupt`` propagates.

        Raises:
            concurrent.futures.CancelledError: the launch was stopped through its
                [`cancel()`][mplaunch.LaunchFuture.cancel].
            TimeoutError: ``timeout`` seconds passed first (``concurrent.futures.TimeoutError`` before 3.11).
            RuntimeError: the launch has not ended and this process was forked from the one that runs it.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython, Jupyter and pytest leave this frame out of tracebacks
        self._check_process()
        try:
            return super().result(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise
        except BaseException as error:
            if error is not self._exception or not raised_by_design(error):
                raise
            # concurrent.futures' frames say nothing of the launch: the caller's line and the worker's
            # traceback (the cause) do
            raise error.with_traceback(None) from error.__cause__

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the launch and return the exception the call would raise, or ``None``; Ctrl-C while
        waiting stops the launch. Raises ``RuntimeError`` as [`result()`][mplaunch.LaunchFuture.result] does."""
        self._check_process()
        try:
            return super().exception(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def _check_process(self) -> None:
        """Raise ``RuntimeError`` in a process forked from the one that runs the unfinished launch."""
        if not self.done():
            forks.check_owner(self._pid, "this launch and its future", "Wait for it, cancel or preempt it there.")

    def _settle(self, value: Any = None, error: BaseException | None = None) -> None:
        with self._settle_lock:
            if self.done():
                return
            self.set_running_or_notify_cancel()
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)


def failed(error: BaseException) -> LaunchFuture[Any]:
    """Return a future that already holds ``error`` (a call refused before any thread started)."""
    future: LaunchFuture[Any] = LaunchFuture(LaunchControl())
    future._settle(error=error)
    return future


def submit(run: Callable[[LaunchControl], T], control: LaunchControl, name: str) -> LaunchFuture[T]:
    """Start ``run(control)`` in a daemon thread named ``mplaunch-<name>`` and return its future."""
    _install_hooks()
    control.stacks_wanted = True  # future.stacks()
    future: LaunchFuture[T] = LaunchFuture(control)
    caller = outside_caller()  # the line that submitted the launch: where the thread's warnings point
    thread = threading.Thread(target=_run, args=(future, run, caller), name=f"mplaunch-{name}", daemon=True)
    future._thread = thread
    with _lock:
        _running.add(future)
    try:
        thread.start()
    except BaseException:
        with _lock:
            _running.discard(future)
        control.close()
        raise
    return future


def submit_stream(
    start: Callable[[LaunchControl], Iterator[Any]], control: LaunchControl, name: str
) -> LaunchFuture[Any]:
    """Submit a call whose ``start(control)`` returns a stream; the future's ``items`` iterate over its values."""
    items: Queued[Any] = Queued()

    def run(control: LaunchControl) -> Any:
        try:
            return items.feed(start(control))
        finally:
            items.end()

    future = submit(run, control, name)
    future.items, items.cancel = items, future.cancel  # type: ignore[attr-defined]
    return future


def _run(future: LaunchFuture[T], run: Callable[[LaunchControl], T], caller: Caller | None) -> None:
    """Run the launch (warnings at ``caller``) and close what it holds, then settle the future ``result()`` awaits."""
    control = future._control
    error: BaseException | None = None
    stopped = False
    try:
        with warnings_for(caller):
            value = run(control)
    except LaunchStopped:
        stopped = True  # cancel() marks the future cancelled once this thread has ended
    except BaseException as raised:  # noqa: BLE001 - the future carries whatever the call would raise
        error = raised
        if raised_by_design(error):  # the launch thread's frames tell nothing: cut them, as a call does
            error.__traceback__, error.__suppress_context__ = None, True
    finally:
        with _lock:
            _running.discard(future)
        control.close()
    if error is not None:
        future._settle(error=error)
    elif not stopped:
        future._settle(value=value)


def stop_all() -> None:
    """Stop every running submitted launch and call's stream of this process: ask them all, then wait for each."""
    with _lock:
        running, streams = list(_running), dict(_streams)
    for control in [*(future._control for future in running), *streams.values()]:
        control.request_stop()
    for future in running:
        future.cancel()
    for stream in streams:
        stream.ended_at_exit()


def stopped_at_exit(stream: Stream[T], control: LaunchControl) -> Stream[T]:
    """Stop the call of ``stream`` at exit, if it runs then, as a submitted launch (``control`` wakes its loop)."""
    _install_hooks()
    with _lock:
        _streams[stream] = control
    return stream


def _install_hooks() -> None:
    """Install, once per process, the hooks that stop running launches."""
    global _hooks_installed
    with _lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(stop_all)  # after multiprocessing's own exit handler, so it runs first (last in, first out)
