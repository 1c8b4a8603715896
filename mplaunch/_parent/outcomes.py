"""The parent's judgement of each rank, from its outcome record, exit code and whether the launch stopped it: one
:data:`RankState`, and the time of a failure, to find a launch's first. Follows torch elastic's ``ProcessFailure``."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import signal

from mplaunch._errors import RemoteError, RemoteTraceback, WorkerExitedError, WorkerFailedError, set_attribute
from mplaunch._wire.records import Outcome, Raised, Returned, Signalled


@dataclasses.dataclass(frozen=True, slots=True)
class Stopped:
    """The launch stopped this rank itself (a peer failed, a timeout, Ctrl-C); not a failure."""

    rank: int


RankState = Returned | Stopped | BaseException  # it returned, the launch stopped it, or it failed (the exception)

#: Seconds by which the parent may see a rank's end late: the kernel frees its memory first (milliseconds), and a
#: busy machine wakes the parent late; a peer's collective fails of the death at about the same time.
NOTICE_SLACK = 0.1
#: Deaths never caused by a peer's failure (unlike NCCL's SIGABRT when a peer is gone, or the launch's SIGTERM).
_OWN_DEATHS = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE") if hasattr(signal, name)
)


def failure_time(outcome: Outcome | None, exitcode: int | None, seen: float) -> float:
    """Return when a rank failed: when it raised, else when its end was ``seen`` (earlier for a death of its own)."""
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
    """Decide what happened to ``rank``: a stopped rank is :class:`Stopped` unless it returned or raised first."""
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
    """Return the error of a rank that ended with no exception of its own (OOM: a SIGKILL while ``oom_kills`` rose)."""
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
    """Rebuild the worker's exception (else a :class:`RemoteError`; an exit: :class:`WorkerExitedError`), with cause."""
    pid = raised.pid
    header = f"rank {rank} (pid {pid})"
    error: BaseException | None = None
    if raised.exception is not None:
        with contextlib.suppress(BaseException):  # SystemExit from a __reduce__ too: sent as text instead
            error = pickle.loads(raised.exception)
    if raised.exit_code is not None or (error is not None and not isinstance(error, Exception)):
        code = raised.exit_code if raised.exit_code is not None else 1
        what = f"raised {raised.message} before returning, so it has no result (exit code {code})"
        error = WorkerExitedError(f"{header} {what}", rank, pid, code)
    if error is None:
        what = (
            f"raised {raised.type_name}: {raised.message} (the exception could not be sent as itself because it "
            "cannot be pickled or unpickled)"
        )
        error = RemoteError(f"{header} {what}", rank, pid, raised.type_name)
    error.__cause__ = RemoteTraceback(f'\n"""\n{header} raised:\n{raised.text}"""')
    set_attribute(error, "rank", rank)
    set_attribute(error, "pid", pid)
    if hasattr(error, "add_note") and not isinstance(error, WorkerFailedError):
        error.add_note(f"(raised in mplaunch worker {header})")
    return error


def unreadable_result(rank: int, pid: int | None, error: BaseException) -> RemoteError:
    """Return the failure of a rank whose result cannot be unpickled here, with ``error`` as its cause."""
    failure = RemoteError(
        f"rank {rank} (pid {pid}) returned a result that cannot be unpickled in the parent: "
        f"{type(error).__name__}: {error}",
        rank,
        pid,
        type(error).__qualname__,
    )
    failure.__cause__ = error
    return failure
