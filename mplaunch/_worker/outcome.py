"""A rank's end: its outcome decided (a signal that came first wins) and written, the exit handlers run, its
children stopped, and the exit with the outcome's status. The parent waits on the process, not the record."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing.util
import os
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

from mplaunch._errors import RemoteError
from mplaunch._platform.csignal import pthread_sigmask
from mplaunch._wire import transport
from mplaunch._wire.pickling import unpicklable_part
from mplaunch._wire.records import Outcome, Raised, Returned, Signalled, outcome_name
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker.children import stop_children
from mplaunch._worker.exit import close_files
from mplaunch._worker.heartbeat import record_usage
from mplaunch._worker.state import state

#: The signals that end a rank's function (``finally`` blocks run): SIGTERM, SIGINT, and those the parent
#: forwards as torchrun does. A handler the function installs for one of them replaces ours.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def decide(outcome: Outcome) -> Outcome:
    """Freeze the outcome: signals no longer raise, one that came first wins; a process the function forked leaves."""
    if os.getpid() != state.pid:
        os._exit(0 if isinstance(outcome, Returned) else 1)
    state.outcome_decided = True
    if state.signal_received is not None and not isinstance(outcome, Returned):
        if isinstance(outcome, Raised) and 0.0 < outcome.when < state.signal_at:
            return outcome  # the function raised before the signal came (it stopped the process group's teardown)
        return Signalled(os.getpid(), state.signal_received)
    return outcome


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Hold the stop signals while a warm rank pickles a call's error: one landing there would cut it short."""
    held = pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        pthread_sigmask(signal.SIG_SETMASK, held)


#: Values that the standard pickler writes as they are: no storage, buffer or function can be in them.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _dump_outcome(spec: WorkerSpec, name: str | None, outcome: Outcome) -> None:
    """Write the outcome as ``name`` in the launch directory, else into this rank's memory file."""
    if name is not None:
        transport.dump(outcome, spec.launch.directory, name)
    else:  # a rank that does not report returns None
        assert spec.outcome_fd is not None
        plain = type(outcome) is Returned and type(outcome.value) in _SCALARS
        transport.dump_fd(outcome, spec.outcome_fd.fd, plain=plain)


def write_outcome(spec: WorkerSpec, rank: int, outcome: Outcome, name: str | None = None) -> Outcome:
    """Write the outcome (``name``: a warm call's) and return it, or the error replacing an unsendable result."""
    in_directory = name is not None or spec.outcome_fd is None
    name = (name or outcome_name(rank)) if in_directory else None
    try:
        _dump_outcome(spec, name, outcome)
        return outcome
    except BaseException as error:  # noqa: BLE001 - the result cannot be sent: report that instead
        if name is not None:
            transport.remove(spec.launch.directory, name)
        if not isinstance(outcome, Returned):
            raise
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt...: an exit, reported as one
            replacement = Raised.of(error)
            kind = f"{type(outcome.value).__module__}.{type(outcome.value).__qualname__}"
            message = f"{replacement.message} while its result (type {kind}) was pickled"
            replacement = dataclasses.replace(replacement, message=message)
        else:
            found = unsendable(f"the result of rank {rank}", "result", outcome.value, error, rank, in_directory)
            replacement = Raised.of(found)
        _dump_outcome(spec, name, replacement)
        return replacement


def unsendable(what: str, root: str, value: object, error: Exception, rank: int, in_directory: bool) -> RemoteError:
    """Return the RemoteError of ``value`` (``what``, its path's ``root``), whose writing raised ``error``."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    how, advice, where = "pickled", "", ""
    if isinstance(error, OSError) and in_directory:
        how = "written to the launch directory"
        advice = " Make room there (e.g. docker run --shm-size=8g) or set MPLAUNCH_SHM_DIR."
    elif isinstance(error, OSError):
        how = "written to shared memory"
    else:
        where = f" ({unpicklable_part(value, root)})"
    message = (
        f"{what} (type {kind}) could not be {how} to send it to the parent{where}: "
        f"{type(error).__name__}: {error}.{advice}"
    )
    failure = RemoteError(message, rank, os.getpid(), kind)
    failure.__cause__ = error
    return failure


def _exit_code(outcome: Outcome | None) -> int:
    if isinstance(outcome, Returned):
        return 0
    if isinstance(outcome, Raised):
        return 1 if outcome.exit_code is None else outcome.exit_code
    signum = outcome.signum if isinstance(outcome, Signalled) else state.signal_received
    return 1 if signum is None else 128 + signum


def finish(spec: WorkerSpec, rank: int, outcome: Outcome | None, *, written: bool = False) -> None:
    """Write the outcome, stop the worker's children, run exit handlers, and leave with the exit status."""
    state.outcome_decided = True
    if outcome is None and state.raised is not None:  # a stop landed while the function's error was recorded
        outcome = decide(Raised.of(state.raised[0], when=state.raised[1]))  # the error, if it came before the stop
    if outcome is None and state.signal_received is not None:  # stopped before the function started
        outcome = Signalled(os.getpid(), state.signal_received)
    try:
        if outcome is not None and not written:
            outcome = write_outcome(spec, rank, outcome)
        exit_handlers(spec, _exit_code(outcome))
    finally:
        leave(_exit_code(outcome))


def leave(code: int) -> NoReturn:
    """Close files and flush the standard streams, then ``os._exit(code)``: left threads cannot keep the rank."""
    try:
        close_files()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
    finally:
        record_usage()
        os._exit(code)


def exit_handlers(spec: WorkerSpec, code: int | None = None) -> None:
    """Run the ``atexit`` handlers while the rank's children run, then stop them, then the finalizers (which join
    children); with the parent's handlers registered, :func:`stop_own_children` leaves with ``code`` before them."""
    if state.parents_exits_kept:
        state.leaving = code
    else:
        atexit.unregister(multiprocessing.util._exit_function)  # type: ignore[attr-defined] # (called below)
    atexit._run_exitfuncs()  # the user's, then stop_own_children
    if not state.children_stopped:  # a handler that cleared atexit skipped it
        stop_children(min(1.0, spec.launch.grace_period / 2), kill=True)
    multiprocessing.util._exit_function()  # type: ignore[attr-defined] # finalizers, e.g. semaphores


def stop_own_children(grace_period: float) -> None:
    """Stop the rank's children (its last ``atexit`` handler; not in a fork); leave if :func:`exit_handlers` asked."""
    if os.getpid() == state.pid:
        stop_children(min(1.0, grace_period / 2), kill=True)
        state.children_stopped = True
        if state.leaving is not None:
            try:
                multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            finally:
                leave(state.leaving)
