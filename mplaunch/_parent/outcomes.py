"""The parent's judgement of each rank: from the outcome a worker wrote (:mod:`mplaunch._wire.records`), its
exit code and whether the launch stopped it, one :data:`RankState`: it returned, the launch stopped it (never
a failure), or it failed (the exception to raise); and when it failed, to find a launch's first failure. The
design follows torch elastic's ``ProcessFailure``.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal

from mplaunch._errors import RemoteError, RemoteTraceback, WorkerExitedError, WorkerFailedError, set_attribute
from mplaunch._wire.records import Outcome, Raised, Returned, Signalled


@dataclasses.dataclass(frozen=True, slots=True)
class Stopped:
    """Parent side: the launch stopped this rank itself (a peer failed, a timeout, Ctrl-C); not a failure."""

    rank: int


#: What the parent makes of one rank: it returned, the launch stopped it, or it failed (the exception).
RankState = Returned | Stopped | BaseException


#: Seconds by which the parent may see a rank's end after it happened: the kernel frees the rank's memory
#: before its end can be seen (milliseconds), and a busy machine wakes the parent late (tens of them). A peer
#: whose collective fails of the death sees the closed connections at about the same time, then raises.
NOTICE_SLACK = 0.1
#: Signals that end a rank from outside or by its own crash, never because a peer failed (unlike SIGABRT,
#: which NCCL's watchdog raises when a peer is gone, or SIGTERM, how a launch stops a rank).
_OWN_DEATHS = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE") if hasattr(signal, name)
)


def failure_time(outcome: Outcome | None, exitcode: int | None, seen: float) -> float:
    """When a rank failed, on ``time.monotonic()``'s clock, to find the first failure of a launch: when it
    raised, by its own clock; for a rank that left no outcome, when its end was ``seen``, and for one a signal
    of :data:`_OWN_DEATHS` ended (the out-of-memory killer's SIGKILL, a segfault), :data:`NOTICE_SLACK`
    earlier: such a death is never a peer's consequence, and a peer's collective failing of it must not
    seem to come first."""
    if isinstance(outcome, Raised):
        return outcome.when
    if outcome is None and exitcode is not None and -exitcode in _OWN_DEATHS:
        return seen - NOTICE_SLACK
    return seen


def rank_state(
    rank: int,
    outcome: Outcome | None,
    exitcode: int | None,
    pid: int | None,
    stopped: bool,
    oom_kills: int | None = None,
) -> RankState:
    """Decide what happened to ``rank`` from its outcome record (``None``: it wrote none), its process exit
    code, and whether the launch had stopped it. A rank the launch stopped is :class:`Stopped` unless it had
    returned (then :class:`Returned`) or had raised on its own before the stop reached it (a failure).
    ``oom_kills``: how many processes the out-of-memory killer ended in the rank's cgroup while it ran, or
    ``None`` where that is unknown."""
    if isinstance(outcome, Returned):
        return outcome
    if isinstance(outcome, Raised):
        return rebuild_exception(outcome, rank)
    if stopped:
        return Stopped(rank)
    if isinstance(outcome, Signalled):
        return exit_error(rank, outcome.pid, exitcode, outcome.signum)
    return exit_error(rank, pid, exitcode, None, oom_kills)


def exit_error(
    rank: int, pid: int | None, exitcode: int | None, signum: int | None, oom_kills: int | None = None
) -> WorkerExitedError:
    """The error for a rank that ended without an exception of its own: killed by a signal (``signum``, or a
    negative ``exitcode``), or an exit with no outcome. ``oom_kills``: as for :func:`rank_state`; only a
    SIGKILL while the count rose is the out-of-memory killer's."""
    error = WorkerExitedError("", rank, pid, exitcode, signum)
    killed = signum is None and error.signal_name == "SIGKILL"
    error.oom = (None if oom_kills is None else oom_kills > 0) if killed else False
    if error.oom:
        what = (
            f"was killed by the out-of-memory killer (SIGKILL; its cgroup counted {oom_kills} out-of-memory "
            "kill(s) while it ran): lower its memory use, or raise the memory limit"
        )
    elif error.signal_name is not None:
        number = signum if signum is not None else -(exitcode or 0)
        what = f"was ended by {error.signal_name} (signal {number}"
        what += f", exit code {exitcode})" if exitcode is not None and exitcode >= 0 else ")"
        if signum is not None:
            what += " that came from outside the launch"
        if killed and error.oom is None:
            what += "; the out-of-memory killer is a possible cause (see `dmesg`), or a `kill -9`"
        elif killed:
            what += "; a `kill -9`? Not the out-of-memory killer: its cgroup counted no out-of-memory kill"
    elif exitcode == 0:
        what = "exited with code 0 before returning (os._exit() or sys.exit() from another thread?)"
    elif exitcode is None:
        what = (
            "ended before returning, and its exit status is unknown: something else in this process reaped it "
            "first (a SIGCHLD handler or a thread that calls os.waitpid(-1, ...)?)"
        )
    else:
        what = f"exited with code {exitcode} before returning"
    error.args = (f"rank {rank} (pid {pid}) {what}",)
    return error


def rebuild_exception(raised: Raised, rank: int) -> BaseException:
    """The worker's exception as itself (or a :class:`RemoteError`), the remote traceback as its cause.

    ``SystemExit`` and ``KeyboardInterrupt`` are not for the parent: they become :class:`WorkerExitedError`
    with the exit code CPython would have used.
    """
    pid = raised.pid
    error: BaseException | None = None
    if raised.exception is not None:
        try:
            error = pickle.loads(raised.exception)
        except BaseException:  # noqa: BLE001 - SystemExit from a __reduce__ too: sent as text instead
            error = None
    if raised.exit_code is not None or (error is not None and not isinstance(error, Exception)):
        code = raised.exit_code if raised.exit_code is not None else 1
        error = WorkerExitedError(
            f"rank {rank} (pid {pid}) raised {raised.message} before returning, so it has no result (exit code {code})",
            rank,
            pid,
            code,
        )
    if error is None:
        error = RemoteError(
            f"rank {rank} (pid {pid}) raised {raised.type_name}: {raised.message} (the exception could not be "
            "sent as itself because it cannot be pickled or unpickled)",
            rank,
            pid,
            raised.type_name,
        )
    header = f"rank {rank} (pid {pid})"
    error.__cause__ = RemoteTraceback(f'\n"""\n{header} raised:\n{raised.text}"""')
    set_attribute(error, "rank", rank)
    set_attribute(error, "pid", pid)
    if hasattr(error, "add_note") and not isinstance(error, WorkerFailedError):
        error.add_note(f"(raised in mplaunch worker {header})")
    return error


def unreadable_result(rank: int, pid: int | None, error: BaseException) -> RemoteError:
    """The failure of a rank whose result cannot be unpickled in the parent (a class this process cannot
    import, a ``__reduce__`` that raises ``SystemExit``...), with ``error`` as its cause."""
    failure = RemoteError(
        f"rank {rank} (pid {pid}) returned a result that cannot be unpickled in the parent: "
        f"{type(error).__name__}: {error}",
        rank,
        pid,
        type(error).__qualname__,
    )
    failure.__cause__ = error
    return failure
