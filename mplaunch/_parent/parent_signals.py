"""The parent's signals during a launch. SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 unwind the parent, which
stops the workers with that signal, so a rank's own handler runs (as torchrun forwards them); SIGINT is Python's
``KeyboardInterrupt``. The caller's handlers are put back after. These signals wait while workers fork
(:func:`signals_held`); an ignored SIGCHLD is reset for the launch (:func:`exit_statuses_kept`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from mplaunch._platform import forks
from mplaunch._platform.csignal import SIG_DFL, SIG_IGN, getsignal, pthread_sigmask, set_handler

#: Signals that end a launch, the workers being stopped with the same signal.
ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: Signals held while workers start; a worker unblocks them once its handlers are in place.
HELD = (signal.SIGINT, *ENDING)


class ParentSignalled(BaseException):
    """Raised in the parent by one of :data:`ENDING` (``signum``) during a launch, to stop the workers first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def ignored_signals() -> frozenset[int]:
    """Return the :data:`HELD` signals workers started now ignore: those ignored here; SIGINT off the main thread."""
    ignored = {signum for signum in HELD if getsignal(signum) == SIG_IGN}
    if threading.current_thread() is not threading.main_thread():
        ignored.add(signal.SIGINT)
    return frozenset(ignored)


def own_group() -> bool:
    """Tell whether ranks launched now take SIGINT in process groups of their own: off the main thread, no terminal."""
    if threading.current_thread() is threading.main_thread() or getsignal(signal.SIGINT) == SIG_IGN:
        return False
    try:  # with one, a rank out of its group would be a background job, stopped by reading the terminal
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
    except OSError as error:
        return error.errno == errno.ENXIO
    return False


@contextlib.contextmanager
def parent_signals() -> Iterator[None]:
    """Let :data:`ENDING` signals unwind the launch, then end as the caller's disposition says (:func:`_end_as`)."""
    with exit_statuses_kept():
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous: dict[int, Any] = {signum: getsignal(signum) for signum in ENDING}
        handled: list[int] = [signum for signum, handler in previous.items() if handler not in (SIG_IGN, None)]
        owner = os.getpid()
        received: list[int] = []

        def handler(signum: int, frame: FrameType | None) -> None:
            if os.getpid() != owner:  # a forked worker that has not yet installed its own handler
                raise SystemExit(128 + signum)
            if _hold.depth:  # signals_held: noted, raised again when the hold ends
                _hold.noted.append(signum)
                return
            received.append(signum)
            if len(received) == 1:  # the first one decides; the launch is already stopping after it
                raise ParentSignalled(signum)

        handler.holds = True  # type: ignore[attr-defined] # signals_held leaves it in place
        for signum in handled:
            set_handler(signum, handler)
        try:
            yield
        except ParentSignalled as stop:
            _restore(previous, handled)
            _end_as(stop.signum, previous[stop.signum])
        finally:
            _restore(previous, handled)


def _restore(previous: dict[int, Any], handled: list[int]) -> None:
    for signum in handled:
        set_handler(signum, previous[signum])


def _end_as(signum: int, previous: Any) -> None:
    """End the parent as ``signum`` would have without mplaunch: die by it, or call its handler and raise."""
    if callable(previous):
        previous(signum, None)
    else:
        os.kill(os.getpid(), signum)  # the default action: die by the signal, as asked
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received during a launch") from None


def sigchld_handled() -> bool:
    """Tell whether the caller handles SIGCHLD (it may reap a worker first: workers then report on the board)."""
    return getsignal(signal.SIGCHLD) not in (SIG_DFL, SIG_IGN)


_children_lock = forks.new_lock()  # maybe held by another thread at a fork
_children_users = 0


@contextlib.contextmanager
def exit_statuses_kept() -> Iterator[None]:
    """While launches run, reset an ignored SIGCHLD (the kernel would reap workers at once) to the default;
    when the last ends, ignore it again and reap what ended meanwhile. Set through libc: from any thread."""
    global _children_users
    setter = _libc_signal()
    with _children_lock:
        reset = _children_users > 0 or (setter is not None and getsignal(signal.SIGCHLD) == SIG_IGN)
        if reset:
            if _children_users == 0:
                setter(signal.SIGCHLD, 0)  # SIG_DFL
            _children_users += 1
    try:
        yield
    finally:
        if reset:
            with _children_lock:
                _children_users -= 1
                if _children_users == 0 and getsignal(signal.SIGCHLD) == SIG_IGN:
                    setter(signal.SIGCHLD, 1)  # SIG_IGN, as found
                    with contextlib.suppress(ChildProcessError, OSError):  # reap what ended meanwhile
                        while os.waitpid(-1, os.WNOHANG)[0] > 0:
                            pass


@functools.lru_cache(maxsize=1)
def _libc_signal() -> Any:
    try:
        setter = ctypes.CDLL(None, use_errno=True).signal
    except (OSError, AttributeError):
        return None
    setter.restype = ctypes.c_void_p
    setter.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return setter


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold :data:`HELD` signals while workers fork or one is reaped (an interrupt there loses its exit code), then
    deliver them: blocked in this thread (a forked child inherits the mask), noted by the main thread's handlers."""
    replaced: dict[int, Any] = {}
    main = threading.current_thread() is threading.main_thread()
    if main:

        def note(number: int, frame: FrameType | None) -> None:
            _hold.noted.append(number)

        for signum in HELD:
            handler = getsignal(signum)
            if callable(handler) and not getattr(handler, "holds", False):  # speed: parent_signals' notes by itself
                replaced[signum] = handler
                set_handler(signum, note)
        _hold.depth += 1
    previous = pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        noted: list[int] = []
        for number, handler in replaced.items():
            set_handler(number, handler)
        if main:
            _hold.depth -= 1
            if not _hold.depth:
                noted, _hold.noted = _hold.noted, []
        pthread_sigmask(signal.SIG_SETMASK, previous)
        for number in dict.fromkeys(noted):
            signal.raise_signal(number)


class _Hold:
    """The main thread's open :func:`signals_held` count and the signals noted meanwhile."""

    def __init__(self) -> None:
        self.depth = 0
        self.noted: list[int] = []


_hold = _Hold()


@forks.in_child
def _forget_holds() -> None:
    """Drop, in a forked child, the parent's hold and what it noted."""
    _hold.depth = 0
    _hold.noted = []
