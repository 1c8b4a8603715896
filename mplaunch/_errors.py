"""The exceptions mplaunch raises, each also the builtin that fits; a worker's is re-raised as itself, the remote
traceback as ``__cause__`` (as CPython's ``concurrent.futures.process`` does)."""

from __future__ import annotations

import dataclasses
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mplaunch._reports import RunReport


class MplaunchError(Exception):
    """Base class of every exception mplaunch raises itself.

    Attributes:
        report: the [`RunReport`][mplaunch.RunReport] of the launch that raised it, else ``None`` (an error raised
            before a launch, e.g. an invalid option).
    """

    report: RunReport | None = None

    def __reduce__(self) -> tuple[object, ...]:
        # rebuilt without __init__, whose parameters differ per class: the state holds every attribute
        return (_rebuild, (type(self), self.args), dict(vars(self)))


def _rebuild(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    error = cls.__new__(cls)
    error.args = args  # (OSError.__new__ drops its arguments where a subclass overrides __init__)
    return error


class InvalidOptionError(MplaunchError, ValueError):
    """An option has a wrong type or value; the message names the option, the value and what is allowed."""


class LaunchRefusedError(MplaunchError, RuntimeError):
    """A check run in the parent before launching failed (main guard, CUDA before fork, unpicklable input), or
    a limit of the machine or container stopped the workers from starting (processes, the environment's size
    for ``exec``, open files); workers started before that are stopped."""


class WorkerFailedError(MplaunchError, RuntimeError):
    """A worker failed in a way that has no exception of its own to re-raise.

    Attributes:
        rank: the global rank of the failed worker.
        pid: its process id, or ``None`` if it never started.
    """

    def __init__(self, message: str, rank: int, pid: int | None) -> None:
        super().__init__(message)
        self.rank: int = rank
        self.pid: int | None = pid


class WorkerExitedError(WorkerFailedError):
    """A worker ended without returning: killed by a signal, a non-zero exit, or an exit with no result.

    Attributes:
        exitcode: the exit code as CPython defines it (``sys.exit()``, ``sys.exit(None)``: 0; ``sys.exit(True)``,
            ``sys.exit("message")``: 1); ``-N`` when killed by signal ``N`` (as in ``multiprocessing``); ``128 + N``
            when the worker caught signal ``N`` (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) and exited.
        signum: the number of the signal that ended the worker, else ``None``.
        signal_name: e.g. ``"SIGKILL"`` or ``"SIGTERM"`` when a signal ended it, else ``None``.
        oom: ``True`` when the kernel's out-of-memory killer ended it (a SIGKILL while the ``oom_kill`` count of its
            cgroup rose: cgroup v2 ``memory.events``, v1 ``memory.oom_control``); ``False`` when not (another signal or
            exit, or no rise); ``None`` when unknowable (a SIGKILL with no count readable). Ranks of the same cgroup
            killed by ``kill -9`` while one was OOM-killed also read ``True``.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        pid: int | None,
        exitcode: int | None,
        signum: int | None = None,
        oom: bool | None = None,
    ) -> None:
        super().__init__(message, rank, pid)
        self.exitcode: int | None = exitcode
        if signum is None and exitcode is not None and exitcode < 0:
            signum = -exitcode
        self.signum: int | None = signum
        self.signal_name: str | None = signal_name(-signum if signum is not None else None)
        self.oom: bool | None = oom


class RemoteError(WorkerFailedError):
    """A worker raised an exception (or returned or yielded a value) that could not be pickled or unpickled.

    The message carries the original type name and message, and the path to a value's part that could not be
    pickled (``result['trainer'].logger: _thread.lock``); ``__cause__`` carries the worker's traceback.

    Attributes:
        type_name: qualified name of the original exception type, e.g. ``"mymod.MyError"``.
    """

    def __init__(self, message: str, rank: int, pid: int | None, type_name: str) -> None:
        super().__init__(message, rank, pid)
        self.type_name: str = type_name


class StallError(WorkerFailedError):
    """A rank that had called [`heartbeat()`][mplaunch.heartbeat] stopped calling it for ``stall_timeout`` seconds;
    every rank's stacks were collected, then every worker was stopped.

    The message names the stalled rank, how long it was silent, and where each rank was (the innermost frame of the
    user's code in each rank's stack). With ``max_restarts``, a stall restarts the workers like any worker failure.

    Attributes:
        silent: seconds since the rank's last heartbeat, when the stall was seen.
        stall_timeout: the option's value, in seconds.
        stacks: each live rank's Python stacks (all threads) as ``faulthandler`` wrote them, by rank; a
            rank that could not dump within about a second is missing.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        pid: int | None,
        silent: float,
        stall_timeout: float,
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, rank, pid)
        self.silent: float = silent
        self.stall_timeout: float = stall_timeout
        self.stacks: dict[int, str] = dict(stacks or {})


class LaunchTimeoutError(MplaunchError, TimeoutError):
    """The launch did not finish within ``timeout`` seconds; every worker was stopped.

    Attributes:
        timeout: the limit, in seconds.
        running: the ranks that were still running when it expired, sorted (empty for a multi-node launch).
        stacks: each of those ranks' Python stacks (all threads) as ``faulthandler`` wrote them just before
            the stop, by rank; a rank that could not dump within about a second is missing (empty for a
            multi-node launch, whose workers torch elastic runs).
    """

    def __init__(
        self, message: str, timeout: float, running: tuple[int, ...], stacks: dict[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.timeout: float = timeout
        self.running: tuple[int, ...] = running
        self.stacks: dict[int, str] = dict(stacks or {})


class PreemptedError(MplaunchError):
    """The launch was preempted: one of ``preempt_signals`` reached the parent (or ``future.preempt()`` was
    called), every rank saw ``mplaunch.preempted()`` become true and had ``preempt_grace`` seconds to save and
    return; the ranks still running then were stopped. Raised even when every rank returned within the grace:
    the work is not done, and a script should requeue (e.g. exit with ``128 + signum``).

    Attributes:
        signum: the signal that preempted the launch, or ``None`` for ``future.preempt()`` without one.
        signal_name: its name, e.g. ``"SIGTERM"``, or ``None``.
        returned: the ranks that returned within the grace, sorted.
        values: their return values by rank, as the call would return them: rank 0's (others ``None``), or
            every rank's with ``return_all=True``.
        stopped: the ranks still running at the end of the grace (or at a second signal), which were stopped.
        failures: exceptions raised by ranks during the grace, in rank order.
    """

    def __init__(
        self,
        message: str,
        signum: int | None,
        values: dict[int, object] | None = None,
        stopped: tuple[int, ...] = (),
        failures: tuple[BaseException, ...] = (),
    ) -> None:
        super().__init__(message)
        self.signum: int | None = signum
        self.signal_name: str | None = signal_name(-signum) if signum is not None else None
        self.values: dict[int, object] = dict(values or {})
        self.returned: tuple[int, ...] = tuple(sorted(self.values))
        self.stopped: tuple[int, ...] = tuple(stopped)
        self.failures: tuple[BaseException, ...] = tuple(failures)


class NodeLostError(MplaunchError, RuntimeError):
    """Another node of a multi-node launch is gone: its launching process stopped sending the rendezvous's
    heartbeats, the rendezvous store it hosted stopped answering, or it closed the rendezvous while this
    node's ranks ran. This node's workers were stopped.

    Attributes:
        node_rank: the lost node's rank in the rendezvous (its ``GROUP_RANK``), or ``None`` when not known (the
            store's host in a launch of more than two nodes, or a node that closed the rendezvous).
        host: the lost node's address as the rendezvous recorded it, or ``None`` when not known.
        launcher_pid: the process id of the lost node's launching process, on its host, or ``None`` when not known.
        endpoint: the rendezvous endpoint of the launch, ``host:port``.
    """

    def __init__(
        self, message: str, node_rank: int | None, host: str | None, launcher_pid: int | None, endpoint: str
    ) -> None:
        super().__init__(message)
        self.node_rank: int | None = node_rank
        self.host: str | None = host
        self.launcher_pid: int | None = launcher_pid
        self.endpoint: str = endpoint


class RemoteTraceback(Exception):
    """The formatted traceback of a worker, attached as ``__cause__`` of the exception re-raised in the parent."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)  # str() is the traceback
        self.tb = tb


def raised_by_design(error: BaseException) -> bool:
    """Return whether mplaunch raises ``error`` by design (its own, a worker's, Ctrl-C): else a bug, traceback kept."""
    return isinstance(error, (MplaunchError, KeyboardInterrupt)) or isinstance(error.__cause__, RemoteTraceback)


def signal_name(exitcode: int | None) -> str | None:
    """Name the signal that killed a process, from a ``multiprocessing`` exit code (``-N``), else ``None``."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclasses.dataclass(frozen=True)
class FailureInfo:
    """Where a failure re-raised by a launch came from, read with [`failure_info()`][mplaunch.failure_info].

    Attributes:
        rank: the global rank whose failure it is.
        pid: that worker's process id, or ``None`` if it never started.
        failures: the other ranks' own failures in the same attempt, by rank (never a rank the launch stopped).
        earlier_attempts: the failures that ended earlier attempts (``max_restarts``), oldest first.
        report: the launch's [`RunReport`][mplaunch.RunReport] (each rank's exit, memory, CPU and wall time).
    """

    rank: int
    pid: int | None
    failures: tuple[BaseException, ...] = ()
    earlier_attempts: tuple[BaseException, ...] = ()
    report: RunReport | None = None


def failure_info(error: BaseException) -> FailureInfo | None:
    """Return where ``error`` came from if a launch raised it for a worker, else ``None``.

    A worker's exception is re-raised in the parent as its own type (``except ValueError:`` works) with
    ``rank``, ``pid``, ``failures`` and ``earlier_attempts`` set on it; type checkers cannot know those
    attributes on a ``ValueError``. This reads them, typed.

    Args:
        error: any exception, e.g. the one caught around a call of a parallel function.

    Returns:
        A [`FailureInfo`][mplaunch.FailureInfo], or ``None`` when ``error`` carries no rank (it did not come from a
        worker: a refused launch, a timeout, an exception of the parent's own).

    Example:
        ```python title="Fragment: train() is a decorated function"
        try:
            train(0.1)
        except ValueError as error:
            info = failure_info(error)
            print(info.rank if info else "raised here")
        ```
    """
    rank = getattr(error, "rank", None)
    if not isinstance(rank, int) or isinstance(rank, bool):
        return None
    pid = getattr(error, "pid", None)
    return FailureInfo(
        rank=rank,
        pid=pid if isinstance(pid, int) else None,
        failures=tuple(getattr(error, "failures", ())),
        earlier_attempts=tuple(getattr(error, "earlier_attempts", ())),
        report=getattr(error, "report", None),
    )


def set_attribute(error: BaseException, name: str, value: Any) -> None:
    """Set an attribute on an exception that may refuse it (slots, read-only properties)."""
    try:
        setattr(error, name, value)
    except (AttributeError, TypeError):
        pass
