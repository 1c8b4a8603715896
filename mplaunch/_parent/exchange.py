"""One call to warm workers: the exchange between the parent and its ranks (see :mod:`mplaunch._parent.team`).

The call is already written to the launch directory. Each rank is told on its pipe, and answers on it when a
value was yielded or its outcome is written; the objects themselves travel as files (one copy). The parent
waits on the pipes and on a pidfd per rank at once, so a rank that dies is seen at once. A call that is
abandoned (Ctrl-C, a failed peer, a closed stream, a timeout, a cancelled future) is interrupted in the ranks
still running it: a CANCEL message, then SIGINT to the rank's main thread. A rank that has not answered
within ``grace_period`` seconds is stopped with the others (SIGTERM, then SIGKILL), and the next call starts
them all again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Generator
from multiprocessing.connection import Connection, wait
from typing import Any

from mplaunch._errors import LaunchTimeoutError
from mplaunch._parent.control import LaunchStopped
from mplaunch._parent.signalling import signal_worker
from mplaunch._parent.signals import signals_held
from mplaunch._parent.team import Team
from mplaunch._platform.ready import LONGEST_WAIT
from mplaunch._wire import transport
from mplaunch._wire.records import (
    CALL,
    CANCEL,
    DONE,
    ITEM,
    READY,
    Outcome,
    Raised,
    RankState,
    Stopped,
    failure_time,
    item_name,
    outcome_name,
    rank_state,
    result_name,
    unreadable_result,
)

_INTERRUPTED = 128 + signal.SIGINT  # the exit code a KeyboardInterrupt's record carries
#: What :func:`exchange` yields first, once the call is sent (not a value: skipped by :func:`start`).
STARTED = (-1, None)


def exchange(
    team: Team, number: int, stop: int | None, timeout: float | None
) -> Generator[tuple[int, Any], None, dict[int, RankState]]:
    """Tell every rank to run call ``number`` (already written) and yield :data:`STARTED`; then yield
    ``(rank, value)`` for each value a reporting rank yields, as it comes; return each rank's state once all
    have answered.

    A failure (a rank raising, or dying) interrupts the ranks still running; ``stop`` (a descriptor)
    becoming readable, ``timeout`` seconds passing, or the generator being closed or interrupted (Ctrl-C)
    interrupts every rank still running, then raises (``LaunchStopped``, ``LaunchTimeoutError``,
    ``GeneratorExit``, ``KeyboardInterrupt``)."""
    # the ranks' start is not the call's (a spawned rank imports torch): it gets ``team.start_timeout``
    starting = len(team.ready) < team.spec.nprocs
    deadline = time.monotonic() + team.start_timeout if starting else None
    if not starting and timeout is not None:
        deadline = time.monotonic() + timeout
    team.failed_at = {}
    pending = set(range(team.spec.nprocs))
    states: dict[int, RankState] = {}
    interrupted: set[int] = set()
    closed: set[int] = set()  # ranks whose pipe reached its end (they died): only their pidfds are watched
    grace: float | None = None  # once interrupted: when the ranks must have answered
    if team.pump is not None:
        team.pump.retarget()  # this call's output goes where the caller's would (its notebook cell)
    takes_ctrl_c = threading.current_thread() is threading.main_thread()  # else only our own CANCEL stops it
    for conn in team.conns:
        with contextlib.suppress(OSError):  # a rank that died: its pidfd tells
            conn.send((CALL, number, takes_ctrl_c))
    try:
        yield STARTED  # the caller takes this at once: the ranks run the call whether or not it is read
        while pending:
            if team.closed:
                raise _closed_error()
            ends = {team.ends[rank]: rank for rank in pending}
            conns = {team.conns[rank]: rank for rank in pending - closed}
            listener = team.store.fileno()
            watched: list[Any] = [*conns, *ends, *(fd for fd in (stop, listener) if fd is not None)]
            limit = min((t for t in (deadline, grace) if t is not None), default=None)
            left = None if limit is None else min(max(0.0, limit - time.monotonic()), LONGEST_WAIT)
            ready = wait(watched, timeout=left)
            seen = time.monotonic()  # when the ends in ready were seen (see _ended)
            if not ready and limit is not None and time.monotonic() < limit:
                continue  # a wait cut to poll's longest (24.8 days): the limit is still ahead
            if not ready or (limit is not None and time.monotonic() >= limit):
                if grace is not None and time.monotonic() >= grace:
                    team.terminate()
                    break
                if starting:
                    team.terminate()  # a rank still importing would die of the SIGINT, printing a traceback
                    raise _start_timeout_error(team.start_timeout, sorted(set(range(team.spec.nprocs)) - team.ready))
                raise _timeout_error(timeout or 0.0, sorted(pending))
            if stop is not None and stop in ready:
                raise LaunchStopped()
            if listener is not None and listener in ready:
                team.store.serve()
            for conn in (c for c in ready if c in conns):
                rank = conns[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    closed.add(rank)  # it ended: its pidfd says so
                    continue
                if message[0] == READY:
                    team.ready.add(rank)
                    if starting and len(team.ready) == team.spec.nprocs:
                        starting = False  # every rank is set up: the call's own time starts now
                        deadline = None if timeout is None else time.monotonic() + timeout
                elif message[0] == ITEM and message[1] == number:
                    name = item_name(number, rank, message[2])
                    value = transport.load(team.spec.directory, name, private=False, remove=True)
                    yield rank, value  # yielded before any interruption reached the rank
                    del value
                elif message[0] == DONE and message[1] == number:
                    pending.discard(rank)
                    states[rank] = _result(team, number, rank, rank in interrupted)
            for end in (e for e in ready if e in ends and ends[e] in pending):
                rank = ends[end]
                if rank not in closed and team.conns[rank].poll(0):
                    continue  # its last messages first (a pipe at its end reads as ready too: then recv says so)
                pending.discard(rank)
                states[rank] = _ended(team, rank, rank in interrupted, seen)
                team.broken = True
            if grace is None and any(isinstance(s, BaseException) for s in states.values()) and pending:
                grace = _interrupt(team, pending, number, interrupted)
    except BaseException as error:
        if os.getpid() != team.pid:  # a forked child closing its copy (garbage collected): the call is the owner's
            raise
        if team.closed:  # at exit, or by another thread: nothing left to stop
            if isinstance(error, (GeneratorExit, KeyboardInterrupt, RuntimeError)):
                raise
            raise _closed_error() from None
        if pending:
            _abandon(team, pending, number, interrupted)
        raise
    finally:
        if os.getpid() == team.pid:
            _clean(team, number)
            if team.pump is not None and not team.closed:
                team.pump.sync()  # the call's output before its value
    for rank in range(team.spec.nprocs):
        states.setdefault(rank, Stopped(rank))
    return states


def start(
    team: Team, number: int, stop: int | None, timeout: float | None
) -> Generator[tuple[int, Any], None, dict[int, RankState]]:
    """:func:`exchange`, with the call already sent to the ranks; closing it interrupts the call."""
    calling = exchange(team, number, stop, timeout)
    next(calling)
    return calling


def _result(team: Team, number: int, rank: int, interrupted: bool) -> RankState:
    """Read rank ``rank``'s outcome of call ``number``."""
    process = team.processes[rank]
    try:
        with signals_held():  # what unpickling raises is the result's own, never a Ctrl-C
            outcome: Outcome = transport.load(
                team.spec.directory, result_name(number, rank), private=False, remove=True
            )
    except BaseException as error:  # noqa: BLE001 - a class this process cannot import, a SystemExit...
        return unreadable_result(rank, process.pid, error)
    if interrupted and isinstance(outcome, Raised) and outcome.exit_code == _INTERRUPTED:
        return Stopped(rank)
    if isinstance(outcome, Raised):
        team.failed_at[rank] = outcome.when
    return rank_state(rank, outcome, 0, process.pid, False)


def _ended(team: Team, rank: int, stopped: bool, seen: float) -> RankState:
    """The state of a rank whose worker ended during a call, its end seen at ``seen`` (``time.monotonic()``):
    the time of its failure if it left no outcome (a signal killed it), not the moment after it was reaped,
    by which time a peer's collective may have failed of its death."""
    process = team.processes[rank]
    if not team.ended(rank):  # (a pidfd readable: it has ended; its status read, whoever reaped it)
        with signals_held():
            process.join()
    try:
        outcome = transport.load(team.spec.directory, outcome_name(rank), private=False, remove=True, missing_ok=True)
    except Exception:  # noqa: BLE001 - judged by its exit code alone
        outcome = None
    team.failed_at[rank] = failure_time(outcome, process.exitcode, seen)
    return rank_state(rank, outcome, process.exitcode, process.pid, stopped)


def _interrupt(team: Team, ranks: set[int], number: int, interrupted: set[int]) -> float:
    """Interrupt call ``number`` in ``ranks``; return by when they must have answered."""
    for rank in ranks - interrupted:
        interrupted.add(rank)
        with contextlib.suppress(OSError):
            team.conns[rank].send((CANCEL, number))
        signal_worker(team.processes[rank], signal.SIGINT)
    return time.monotonic() + team.spec.grace_period


def _abandon(team: Team, pending: set[int], number: int, interrupted: set[int]) -> None:
    """Interrupt the call in ``pending`` and wait for their answers (discarded); stop the workers if they
    do not answer within ``grace_period`` seconds, or on a second Ctrl-C."""
    closed: set[int] = set()  # ranks whose pipe reached its end
    try:
        deadline = _interrupt(team, pending, number, interrupted)
        while pending and time.monotonic() < deadline:
            conns = {team.conns[rank]: rank for rank in pending - closed}
            ends = {team.ends[rank]: rank for rank in pending}
            watched: list[Any] = [*conns, *ends]
            for ready in wait(watched, timeout=max(0.0, deadline - time.monotonic())):
                if isinstance(ready, int):
                    pending.discard(ends[ready])
                    team.broken = True
                    continue
                assert isinstance(ready, Connection)
                try:
                    if ready.recv()[:2] == (DONE, number):
                        pending.discard(conns[ready])
                except (EOFError, OSError):
                    closed.add(conns[ready])  # it died: its pidfd says so
    finally:
        if pending:
            team.terminate()


def _clean(team: Team, number: int) -> None:
    """Remove what call ``number`` left in the launch directory (values nobody read, the call)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(team.spec.directory, "post-mortem"))  # the next call's failure may debug
    prefixes = (
        f"call{number}.",
        f".call{number}.",
        f"item{number}-",
        f".item{number}-",
        f"result{number}-",
        f".result{number}-",
    )
    with contextlib.suppress(OSError):
        for entry in os.listdir(team.spec.directory):
            if entry.startswith(prefixes):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(team.spec.directory, entry))


def _timeout_error(timeout: float, running: list[int]) -> LaunchTimeoutError:
    """The error of a call that ran past ``timeout`` seconds."""
    return LaunchTimeoutError(
        f"the call did not finish within timeout={timeout:g} s; ranks {running} were still running and have "
        "been interrupted. Raise `timeout`, or look for a rank stuck in a collective.",
        timeout,
        tuple(running),
    )


def _start_timeout_error(timeout: float, starting: list[int]) -> LaunchTimeoutError:
    """The error of ranks that were not set up within ``timeout`` seconds of their start."""
    return LaunchTimeoutError(
        f"ranks {starting} did not finish starting within rdzv_timeout={timeout:g} s; every rank has been "
        "stopped, and the next call starts them again. Raise `rdzv_timeout`, or look for a rank stuck while "
        "importing or joining its process group.",
        timeout,
        tuple(starting),
    )


def _closed_error() -> RuntimeError:
    return RuntimeError("the mplaunch.Workers were closed while this call ran; its ranks were stopped")
