"""The parent's signals during a launch.

SIGTERM ends the launch: it unwinds the parent, so the workers are stopped first. SIGHUP (a closed SSH
session), SIGQUIT, SIGUSR1 and SIGUSR2 do the same, and the workers are stopped with that signal instead of
SIGTERM, so a rank's own handler for it runs, as torchrun forwards them (``TORCHELASTIC_SIGNALS_TO_HANDLE``).
The caller's handlers are put back after the launch. SIGINT is Python's ``KeyboardInterrupt``. While
workers are forked these signals wait (:func:`signals_held`), and a SIGCHLD the caller ignores is reset for
the launch (:func:`exit_statuses_kept`), so that every worker's exit status can be read.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from mplaunch._platform import forks
from mplaunch._platform.csignal import SIG_DFL, SIG_IGN, getsignal, pthread_sigmask, set_handler

#: Signals that end a launch, the workers being stopped with the same signal (SIGTERM is how a launch stops
#: its workers anyway).
ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: Signals held while workers start; a worker unblocks them once its handlers are in place.
HELD = (signal.SIGINT, *ENDING)


class ParentSignalled(BaseException):
    """Raised in the parent by one of :data:`ENDING` during a launch, to unwind and stop the workers first.

    Args:
        signum: the signal received; the workers are stopped with it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def ignored_signals() -> frozenset[int]:
    """The signals of :data:`HELD` that the workers of a launch made now, from this thread, ignore: those this
    process ignores (``SIG_IGN``), and SIGINT for a launch from another thread than the main thread.

    Python gives SIGINT to the main thread, and the main thread decides what a Ctrl-C stops: a submitted
    launch is stopped when an interrupted notebook cell ends, when ``result()`` is interrupted, or at exit.
    The workers of such a launch, in the terminal's foreground job too, leave the terminal's Ctrl-C to it.
    """
    ignored = {signum for signum in HELD if getsignal(signum) == SIG_IGN}
    if threading.current_thread() is not threading.main_thread():
        ignored.add(signal.SIGINT)
    return frozenset(ignored)


@contextlib.contextmanager
def parent_signals() -> Iterator[None]:
    """During the launch, let the signals of :data:`ENDING` unwind the parent (the workers are stopped with
    the signal received); then end as the caller's disposition says, and put the caller's handlers back.

    A signal the caller ignores stays ignored, and one whose handler was not set from Python (e.g.
    ``faulthandler.register``) is left alone. After the workers are stopped, the parent ends as it would have
    without mplaunch: with the default disposition it dies by the signal; with a Python handler, that handler
    is called (with frame ``None``) and, if it returns, the call raises ``KeyboardInterrupt``. Only the main
    thread can set handlers: a launch from another thread (``submit()``) leaves them as they are.
    """
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
    """End the parent as ``signum`` would have without mplaunch: call the caller's handler, else die by it."""
    name = signal.Signals(signum).name
    if callable(previous):
        previous(signum, None)
    else:
        os.kill(os.getpid(), signum)  # the default action: die by the signal, as asked
    raise KeyboardInterrupt(f"{name} received during a launch") from None


def sigchld_handled() -> bool:
    """Whether the caller handles SIGCHLD (a Python handler; ``None``: one set outside Python): a handler that
    reaps every child (a common server pattern) may reap a forked worker before the launch reads the kernel's
    account of it (peak memory, CPU time), so the workers then leave their own on the board."""
    return getsignal(signal.SIGCHLD) not in (SIG_DFL, SIG_IGN)


_children_lock = forks.new_lock()  # maybe held by another thread at a fork
_children_users = 0


@contextlib.contextmanager
def exit_statuses_kept() -> Iterator[None]:
    """While launches run, reset a SIGCHLD that the caller ignores to the default, so that the workers' exit
    codes and signals can be read (with SIGCHLD ignored, the kernel reaps ended children at once); put it
    back when the last launch ends, and reap the children that ended meanwhile, as ignoring SIGCHLD would have.

    It works from any thread: the disposition is set through libc, out of Python's sight.
    """
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
                    _reap_ended()


def _reap_ended() -> None:
    """Reap the children that ended while SIGCHLD was not ignored (the caller expects none to linger)."""
    with contextlib.suppress(ChildProcessError, OSError):
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
    """Hold the signals of :data:`HELD` for a moment that must not be cut, and deliver them after: while
    workers fork, and while a worker is reaped (a KeyboardInterrupt between multiprocessing's ``waitpid`` and
    its noting the exit code would lose the worker's status for good).

    They are blocked in this thread: a forked child inherits the mask, so a signal sent to it before it has
    installed its own handlers waits instead of unwinding the parent's stack copied into it (the worker
    unblocks them first thing). The kernel may still hand the parent's signal to another thread (a notebook
    kernel's, a timer's), and Python would then run the handler in the main thread at any point, for
    instance inside logging's fork hook, where CPython only prints the KeyboardInterrupt and drops it. So in
    the main thread the Python handlers meanwhile only note what came, and it is raised again, to the real
    handlers, on exit.
    """
    replaced: dict[int, Any] = {}
    main = threading.current_thread() is threading.main_thread()
    if main:

        def note(number: int, frame: FrameType | None) -> None:
            _hold.noted.append(number)

        for signum in HELD:
            handler = getsignal(signum)
            if callable(handler) and not getattr(handler, "holds", False):  # (parent_signals' notes by itself)
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
    """The main thread's :func:`signals_held`: how many are open, and the signals noted meanwhile (raised
    again when the outermost ends). :func:`parent_signals`' handler stays in place during a hold and notes
    by itself, so that a hold swaps only the handlers that are not mplaunch's (two system calls each); it
    used to swap six, eight times per launch."""

    def __init__(self) -> None:
        self.depth = 0
        self.noted: list[int] = []


_hold = _Hold()


@forks.in_child
def _forget_holds() -> None:
    """In a child forked during a hold (a worker): the hold, and what it noted, are the parent's."""
    _hold.depth = 0
    _hold.noted = []
