"""The records that cross the boundary between the parent and its workers, and the names they travel under.

The parent writes one :class:`Payload` (the call) for workers that cannot inherit it and starts each worker
with the :class:`WorkerSpec`; every worker writes exactly one outcome record for its rank before it exits:
:class:`Returned`, :class:`Raised`, or :class:`Signalled` (a stop signal ended it). The parent reads
the records, knows which ranks it stopped itself, and turns them into one :data:`RankState` per rank:
``Returned``, ``Stopped`` (the launch stopped it: never a failure), or a failure (an exception to raise).
Worker, supervisor and elastic code depend on this module, not on each other. The design follows CPython's
``concurrent.futures.process`` (``_CallItem``, ``_ResultItem``) and torch elastic's ``ProcessFailure``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mplaunch._errors import RemoteError, RemoteTraceback, WorkerExitedError, WorkerFailedError
from mplaunch._frames import without_our_frames

if TYPE_CHECKING:
    from mplaunch._output.fds import RankFds
    from mplaunch._state.snapshot import ForkState, GlobalState
    from mplaunch._wire.fds import InheritedFd
    from mplaunch._wire.placement import RankPlacement

#: Name of the call in the launch directory.
PAYLOAD = "payload"
#: Rank 0's outcome, fetched by a node of a multi-node launch that does not run rank 0.
REMOTE_RANK0 = "remote-rank0"
_RANK_PREFIX = "rank"


def outcome_name(rank: int) -> str:
    """The name under which rank ``rank`` writes its outcome in the launch directory."""
    return f"{_RANK_PREFIX}{rank}"


def outcome_rank(filename: str) -> int | None:
    """The rank whose complete outcome ``filename`` (an entry of the launch directory) is, else ``None``."""
    stem, dot, extension = filename.partition(".")
    number = stem[len(_RANK_PREFIX) :]
    if stem.startswith(_RANK_PREFIX) and number.isascii() and number.isdigit() and dot and extension == "pkl":
        return int(number)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker of one launch needs to know; small, so starting a worker sends little.

    Attributes:
        directory: the launch directory, where the payload and outcomes are written.
        nprocs: workers of this launch (on this node).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        parent_pid: pid of the launching process, which the worker must not outlive.
        master_addr, master_port: the rendezvous store.
        agent_store: the parent hosts the store (torchrun's agent store).
        num_threads: intra-op threads for the worker.
        reporting_ranks: ranks whose return value is sent back (the others send ``None``).
        environ: the parent's environment for forkserver workers (they inherit the server's), else ``None``.
        grace_period: seconds a stopped worker has before SIGKILL; its own children get part of it.
        mp_start_method: the parent's ``multiprocessing`` default start method if it set one, else ``None``
            (the platform's default, as in a process that torchrun starts).
        restart_count, max_restarts: this attempt's ``TORCHELASTIC_RESTART_COUNT`` and the launch's
            ``TORCHELASTIC_MAX_RESTARTS``.
        unshare: forked workers must look for arguments in shared memory (see ``unshare_verdict``);
            ``None``: the arguments are large, and the parent says whether through ``unshare_pipe``.
        unshare_pipe: ``(read end, write end)`` of the pipe on which the parent, once every forked worker
            has started, writes one byte per worker: ``b"1"`` to look, ``b"0"`` not to.
        ignored_signals: the stop signals the workers ignore (SIGTERM never): those the caller ignores (e.g.
            SIGHUP under ``nohup``), and SIGINT for a launch from a thread other than the main thread.
        output_fds: per local rank, the descriptors that replace fd 1 and 2 when output is routed, else
            ``None`` (see :mod:`mplaunch._output.fds`).
        start_objects: the call's objects that ``multiprocessing`` sends only to a starting process (queues,
            locks, ``Pipe`` ends...), which the payload refers to by index: they travel here, pickled by each
            worker's start (see :mod:`mplaunch._wire.start_objects`).
        placements: per local rank, its devices, CPUs and extra variables, or ``None`` (see
            :mod:`mplaunch._wire.placement`).
        result_wait: seconds the first worker of a node other than rank 0's waits for rank 0's result in the
            rendezvous store (multi-node): what is left of ``timeout``, else ``rdzv_timeout``.
        env_function: ``env=``'s function of the global rank, called in each worker of a multi-node launch
            (where the parent does not know the ranks), else ``None``.
        payload_fd: the memory file holding the :class:`Payload` (see :func:`~mplaunch._wire.transport.dump_fd`),
            or ``None``: it is inherited (fork) or in the launch directory.
        outcome_fds: the parent's table, per local rank, of the memory files the ranks write their outcomes
            into, or ``None``: they write them to the launch directory. Never sent to a worker.
        outcome_fd: the worker's own entry of ``outcome_fds``.
        post_mortem: the first rank that raises opens pdb on the terminal (see
            :mod:`mplaunch._worker.debugger`).
        stacks: the parent may ask the ranks for their stacks (a ``timeout``, a ``stall_timeout``, a future's
            ``stacks()``): each installs its dump handler. Without, none does, and none is asked.
        board: the launch has a board that each rank opens: ``stall_timeout``'s heartbeats, and the usage of
            workers the parent may not reap itself (a fork server's, which are not its children; spawned ones,
            which ``multiprocessing`` reaps when another thread starts a process).
    """

    directory: str
    nprocs: int
    start_method: str
    parent_pid: int
    num_threads: int
    reporting_ranks: frozenset[int]
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = True
    environ: dict[str, str] | None = None
    backend: str | None = None
    prefix_output: bool | str = False
    console_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    grace_period: float = 5.0
    mp_start_method: str | None = None
    unshare: bool | None = True
    unshare_pipe: tuple[int, int] | None = None
    restart_count: int = 0
    max_restarts: int = 0
    ignored_signals: frozenset[int] = frozenset()
    output_fds: tuple[RankFds, ...] | None = None  # per local rank: what replaces fd 1 and 2 (see _output)
    payload_fd: InheritedFd | None = None
    outcome_fds: tuple[InheritedFd, ...] | None = None
    outcome_fd: InheritedFd | None = None
    start_objects: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    placements: tuple[RankPlacement, ...] | None = None
    env_function: Callable[[int], Any] | None = None
    post_mortem: bool = False
    stacks: bool = True
    board: bool = True
    result_wait: float = 600.0


@dataclasses.dataclass(frozen=True, slots=True)
class Payload:
    """The function, its arguments and the parent's state (what a forked worker does not inherit as it is,
    when the launch forks at once); under fork it is inherited, else read from a file."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: GlobalState | ForkState


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One call to warm workers (:class:`mplaunch.Workers`), written once to the launch directory as
    :func:`call_name` and read by every rank: the plain function, its arguments, and the file it was defined
    in (tracebacks and debuggers show it, where a function sent by value would say ``<dynamic-code>``)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    filename: str | None = None  # the function's source file: cloudpickle sends code without it


def call_name(number: int) -> str:
    """The name of warm call ``number`` in the launch directory."""
    return f"call{number}"


def result_name(number: int, rank: int) -> str:
    """The name of rank ``rank``'s outcome of warm call ``number`` (read by the parent, then removed)."""
    return f"result{number}-{rank}"


def item_name(number: int, rank: int, index: int) -> str:
    """The name of the ``index``-th value that rank ``rank`` yielded in warm call ``number``."""
    return f"item{number}-{rank}-{index}"


#: Control messages on a warm rank's pipe (small tuples; the objects travel as files, see above).
#: Parent to rank: ``(CALL, number, takes_ctrl_c, report_all)`` run call ``number`` (a SIGINT to the caller's
#: group interrupts it only if ``takes_ctrl_c``: it was made from the caller's main thread; every rank sends its
#: value with ``report_all``); ``(CANCEL, number)``
#: it is no longer wanted (sent before the SIGINT that interrupts it); ``(EXIT,)`` leave (a call that runs is
#: interrupted). Rank to parent:
#: ``(READY,)`` the rank is set up (once, before its first call); ``(ITEM, number, index)`` a value was
#: yielded; ``(DONE, number)`` the outcome is written.
CALL, CANCEL, EXIT, ITEM, DONE, READY = "call", "cancel", "exit", "item", "done", "ready"


@dataclasses.dataclass(frozen=True, slots=True)
class Returned:
    """The function returned ``value`` (``None`` for ranks that do not report)."""

    pid: int
    value: Any

    def __reduce__(self) -> tuple[Any, ...]:
        # the fields as arguments: a slotted dataclass's own state functions cost a worker a dozen calls
        return (Returned, (self.pid, self.value))


@dataclasses.dataclass(frozen=True, slots=True)
class Raised:
    """The function raised. ``exception`` is the pickled exception, or ``None`` when it cannot be pickled.

    Attributes:
        exit_code: for ``SystemExit`` (and ``KeyboardInterrupt``), the process exit code CPython would use,
            else ``None``.
        when: ``time.monotonic()`` when it was raised, so that the first failure of a launch is known whatever
            order the processes end in (a rank's error often makes its peers fail in a collective).
    """

    pid: int
    exception: bytes | None
    type_name: str
    message: str
    text: str  # the formatted traceback
    exit_code: int | None = None
    when: float = 0.0  # time.monotonic() when it was raised (one clock for the processes of a machine)

    @classmethod
    def of(cls, error: BaseException, when: float | None = None) -> Raised:
        """The record of ``error``, raised in this process at ``when`` (``time.monotonic()``; default now);
        never raises itself."""
        tb = without_our_frames(error.__traceback__)
        try:
            text = "".join(traceback.format_exception(type(error), error, tb))
        except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error
            text = "".join(traceback.format_tb(error.__traceback__)) + _safely(repr, error)
        try:
            exception: bytes | None = _pickle_exception(error)
        except BaseException:  # noqa: BLE001 - an exception that cannot be pickled (even by exiting) travels as text
            exception = None
        exit_code = exit_status(error.code) if isinstance(error, SystemExit) else None
        if isinstance(error, KeyboardInterrupt):
            exit_code = 128 + signal.SIGINT
        return cls(
            pid=os.getpid(),
            exception=exception,
            type_name=f"{type(error).__module__}.{type(error).__qualname__}",
            message=_safely(str, error) if exit_code is None else _safely(repr, error),
            text=text,
            exit_code=exit_code,
            when=time.monotonic() if when is None else when,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Signalled:
    """The worker was ended by signal ``signum`` that it caught (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1,
    SIGUSR2), before it had returned."""

    pid: int
    signum: int


Outcome = Returned | Raised | Signalled


@dataclasses.dataclass(frozen=True, slots=True)
class Stopped:
    """Parent side: the launch stopped this rank itself (a peer failed, a timeout, Ctrl-C); not a failure."""

    rank: int


#: What the parent makes of one rank: it returned, the launch stopped it, or it failed (the exception).
RankState = Returned | Stopped | BaseException


def exit_status(code: object) -> int:
    """The exit status CPython gives ``sys.exit(code)``: ``None`` -> 0, an int (or bool) -> itself, anything
    else -> 1 (the object is printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    return 1


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


def set_attribute(error: BaseException, name: str, value: Any) -> None:
    """Set an attribute on an exception that may refuse it (slots, read-only properties)."""
    try:
        setattr(error, name, value)
    except (AttributeError, TypeError):
        pass


def _safely(describe: Callable[[BaseException], str], error: BaseException) -> str:
    try:
        return describe(error)
    except Exception as failure:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"<{type(error).__qualname__}: {describe.__name__}() failed with {type(failure).__name__}>"


def _pickle_exception(error: BaseException) -> bytes:
    import cloudpickle

    traceback_, cause, context = error.__traceback__, error.__cause__, error.__context__
    try:
        error.__traceback__ = None
        try:
            return pickle.dumps(error)
        except Exception:  # noqa: BLE001
            data: bytes = cloudpickle.dumps(error)
            return data
    finally:
        error.__traceback__, error.__cause__, error.__context__ = traceback_, cause, context


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
