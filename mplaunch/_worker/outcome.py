"""A rank's outcome and its end: the outcome decided (a signal that came first wins), written for the parent,
then the exit handlers, the rank's children stopped, and the exit with the outcome's status.

A worker writes exactly one outcome record (:mod:`mplaunch._wire.records`) per call and then exits; the
parent waits on the process, not on the record.
"""

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
from mplaunch._wire.records import Outcome, Raised, Returned, Signalled, outcome_name
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker.children import stop_children
from mplaunch._worker.exit import close_files
from mplaunch._worker.heartbeat import record_usage
from mplaunch._worker.state import state

#: The signals that end a rank's function (``finally`` blocks run): SIGTERM (the launch stopping it), SIGINT (a
#: terminal's Ctrl-C), and those the parent forwards as torchrun does (SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2). A
#: handler the function installs for one of them replaces this one.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def decide(outcome: Outcome) -> Outcome:
    """Freeze the outcome: from now on signals no longer raise. A signal that came first wins.

    A process the function forked (``os.fork()``) that returns or raises instead of exiting comes here too:
    it is not the worker, so it leaves at once, quietly, and never writes the rank's outcome.
    """
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
    """Hold the stop signals while a warm rank records a call's error (:meth:`Raised.of`): one that landed
    there would cut the pickling of the error short, and the rank would go on serving calls. It is delivered
    when the block ends, and ends the rank as it would a moment later."""
    held = pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        pthread_sigmask(signal.SIG_SETMASK, held)


#: Values that the standard pickler writes as they are: no storage, buffer or function can be in them.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _dump_outcome(spec: WorkerSpec, name: str | None, outcome: Outcome) -> None:
    """Write the outcome as ``name`` in the launch directory, else (``None``) into this rank's memory file."""
    if name is not None:
        transport.dump(outcome, spec.launch.directory, name)
    else:  # a rank that does not report returns None
        assert spec.outcome_fd is not None
        plain = type(outcome) is Returned and type(outcome.value) in _SCALARS
        transport.dump_fd(outcome, spec.outcome_fd.fd, plain=plain)


def write_outcome(spec: WorkerSpec, rank: int, outcome: Outcome, name: str | None = None) -> Outcome:
    """Write the outcome (as ``name`` in the launch directory, a warm call's; by default as the rank's exit
    outcome, see :func:`_dump_outcome`); a result that cannot be pickled or written is replaced by the error
    saying so. Returns what was written."""
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
        kind = f"{type(outcome.value).__module__}.{type(outcome.value).__qualname__}"
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt...: an exit, as if the function had
            exited = Raised.of(error)
            exited = dataclasses.replace(exited, message=f"{exited.message} while its result (type {kind}) was pickled")
            _dump_outcome(spec, name, exited)
            return exited
        how = "pickled"
        if isinstance(error, OSError):
            how = "written to the launch directory" if in_directory else "written to shared memory"
        advice = ""
        if isinstance(error, OSError) and in_directory:
            advice = " Make room there (e.g. docker run --shm-size=8g) or set MPLAUNCH_SHM_DIR."
        failure = RemoteError(
            f"the result of rank {rank} (type {kind}) could not be {how} to send it to the parent: "
            f"{type(error).__name__}: {error}.{advice}",
            rank,
            os.getpid(),
            kind,
        )
        failure.__cause__ = error
        replacement = Raised.of(failure)
        _dump_outcome(spec, name, replacement)
        return replacement


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
    """End the rank with exit status ``code``: first what a normal exit does for data (``logging.shutdown``,
    open files flushed and closed, the standard streams flushed), then ``os._exit``, so that threads the
    function left running cannot keep the worker (and the call) alive."""
    try:
        close_files()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
    finally:
        record_usage()
        os._exit(code)


def exit_handlers(spec: WorkerSpec, code: int | None = None) -> None:
    """Run the ``atexit`` handlers while the processes the rank started still run (an experiment tracker
    finishes its run through its helper process), then stop what is left, then multiprocessing's finalizers,
    in the order a normal interpreter exit has them.

    multiprocessing's own exit function joins the rank's non-daemonic children: it runs only once they are
    stopped (:func:`stop_own_children`, registered first so it runs last), so a child that never ends cannot
    keep the worker. Where the parent's handlers are still registered below it (``code``: the rank is
    leaving with that exit status), that handler also runs the finalizers and ends the rank (:func:`leave`),
    so that none of the parent's runs.
    """
    if state.parents_exits_kept:
        state.leaving = code
    else:
        atexit.unregister(multiprocessing.util._exit_function)  # type: ignore[attr-defined] # (called below)
    atexit._run_exitfuncs()  # the user's, then stop_own_children
    if not state.children_stopped:  # a handler that cleared atexit skipped it
        stop_children(min(1.0, spec.launch.grace_period / 2), kill=True)
    multiprocessing.util._exit_function()  # type: ignore[attr-defined] # finalizers, e.g. semaphores


def stop_own_children(grace_period: float) -> None:
    """The last ``atexit`` handler of a worker: stop what the rank started and what is still running, SIGKILL
    after ``min(1, grace_period / 2)`` seconds; then, if the rank is leaving with the parent's handlers
    registered below this one, multiprocessing's finalizers and the rank's end (see :func:`exit_handlers`).
    Does nothing in a process the function forked."""
    if os.getpid() == state.pid:
        stop_children(min(1.0, grace_period / 2), kill=True)
        state.children_stopped = True
        if state.leaving is not None:
            try:
                multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            finally:
                leave(state.leaving)
