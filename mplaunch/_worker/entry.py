"""What runs in a worker process, before and after the user's function.

A worker writes exactly one outcome record (:mod:`mplaunch._wire.records`) and then exits; the parent waits on
the process, not on the record. A stop signal (SIGTERM, SIGINT, or one the parent forwards; from the
launch, a terminal or someone else) ends the function as :class:`Terminated` / :class:`Interrupted`, and
whatever the function raises after that is a consequence of the signal: the outcome is then
:class:`~mplaunch._protocol.Signalled`, never a failure of its own. Once the outcome is decided, further
signals are noted and ignored, so writing the outcome and the exit handlers are never interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from multiprocessing.connection import Connection
from typing import Any, NoReturn, TextIO

import torch

from mplaunch._env import WORKER_VARIABLE, apply_environment, rank_environment, replacing
from mplaunch._errors import NodeLostError, RemoteError
from mplaunch._output.fds import take_fds, terminal_stdin
from mplaunch._platform import forks
from mplaunch._platform.environ import ForkEnviron, c_getenv, fork_environs, replace_environ
from mplaunch._platform.proctree import become_subreaper, set_parent_death_signal
from mplaunch._platform.signals import SIG_DFL, SIG_IGN, getsignal, pthread_sigmask, set_handler
from mplaunch._state.sharing import unshare
from mplaunch._wire import flags, pickling, transport
from mplaunch._wire.fds import close_memory_files, close_quietly
from mplaunch._wire.records import (
    ITEM,
    PAYLOAD,
    REMOTE_RANK0,
    Outcome,
    Payload,
    Raised,
    Returned,
    Signalled,
    WorkerSpec,
    item_name,
    outcome_name,
)
from mplaunch._worker import placement
from mplaunch._worker.children import stop_children
from mplaunch._worker.debugger import BreakpointPlan, breakpoint_plan, install_breakpoint_hook, post_mortem
from mplaunch._worker.exit import InheritedLogging, close_files, inherited_logging, keep_inherited
from mplaunch._worker.process_group import forget_inherited_groups, has_groups, process_group
from mplaunch._worker.rendezvous import follow_own_rendezvous
from mplaunch._worker.watch import record_usage, watch

#: The signals that end a rank's function (``finally`` blocks run): SIGTERM (the launch stopping it), SIGINT (a
#: terminal's Ctrl-C), and those the parent forwards as torchrun does (SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2). A
#: handler the function installs for one of them replaces this one.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_signal_received: int | None = None  # the first stop signal this worker got
_signal_at = 0.0  # when (time.monotonic()) it came
_raised: tuple[BaseException, float] | None = None  # what the function raised, and when: its outcome, whatever follows
_outcome_decided = False  # after this, signals are noted and ignored
_worker_pid = -1  # this worker's pid, set at start (a process the function forks is not the worker)
_children_stopped = False  # the last exit handler stopped what the rank started
_parents_exits_kept = False  # the parent's atexit handlers stay registered, below the rank's own (see _start)
_leaving: int | None = None  # the exit code with which the rank's last atexit handler ends it (see _finish)
_environ_made = False  # the rank installed the environment its parent made for it (fork_environs)


def _die_with_parent(parent_pid: int, start_method: str) -> None:
    """Make sure this worker dies when the launching process dies, even by SIGKILL; exit now if it is gone.

    Under fork and spawn the launching process is the parent: Linux's ``PR_SET_PDEATHSIG`` sends SIGKILL (as
    in ``torch.multiprocessing.spawn`` workers).
    Under forkserver the parent is the fork server, which outlives a killed launcher (its children keep the
    server's "alive" pipe open), so a daemon thread waits on a pidfd of the launching process instead.
    """
    if not sys.platform.startswith("linux"):
        return
    if start_method != "forkserver":
        if not set_parent_death_signal(signal.SIGKILL):
            return
        if os.getppid() != parent_pid:
            os._exit(1)
        return
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # kernel < 5.3
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mplaunch-parent-watch", daemon=True).start()


class Terminated(SystemExit):
    """Raised in a worker by SIGTERM (the launch stopping it, or a ``kill``), SIGHUP, SIGQUIT, SIGUSR1 or
    SIGUSR2; a ``SystemExit``, so ``finally`` blocks run and ``except Exception`` does not swallow it."""


class Interrupted(KeyboardInterrupt):
    """Raised in a worker by SIGINT sent to it."""


def _on_signal(signum: int, frame: object) -> None:
    global _signal_received, _signal_at
    first = _signal_received is None
    if first:
        _signal_received, _signal_at = signum, time.monotonic()
    if first and not _outcome_decided:
        # before unwinding: e.g. DataLoader workers would print about a vanished rank
        stop_children(0.25, kill=False)
        _quiet_consequences()
        raise Interrupted() if signum == signal.SIGINT else Terminated(128 + signum)


def _quiet_consequences() -> None:
    """A stop prints nothing: errors that unwinding causes where nobody can catch them (a ``__del__``, e.g. of
    a DataLoader iterator interrupted in its ``__init__``, or a thread of the rank) are dropped, not printed.
    What the function itself prints while it unwinds (``finally`` blocks) still appears."""
    sys.unraisablehook = _ignore
    threading.excepthook = _ignore


def _ignore(*args: object) -> None:
    """Swallow an unraisable or thread exception (see :func:`_quiet_consequences`)."""


@forks.in_child
def _default_signals() -> None:
    """In a process forked by a worker: the stop signals as in any Python process, not the worker's.

    Runs in every child of a process that imported mplaunch; in one of a process that is no worker, it
    does nothing."""
    if _worker_pid == -1:
        return
    for signum in _STOP_SIGNALS:
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def _set_threads(num_threads: int) -> None:
    if not _environ_made:  # (the parent put OMP_NUM_THREADS in a made one: see _rank_fork_changes)
        placement.set_changed({"OMP_NUM_THREADS": str(num_threads)})
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def _decide(outcome: Outcome) -> Outcome:
    """Freeze the outcome: from now on signals no longer raise. A signal that came first wins.

    A process the function forked (``os.fork()``) that returns or raises instead of exiting comes here too:
    it is not the worker, so it leaves at once, quietly, and never writes the rank's outcome.
    """
    if os.getpid() != _worker_pid:
        os._exit(0 if isinstance(outcome, Returned) else 1)
    global _outcome_decided
    _outcome_decided = True
    if _signal_received is not None and not isinstance(outcome, Returned):
        if isinstance(outcome, Raised) and 0.0 < outcome.when < _signal_at:
            return outcome  # the function raised before the signal came (it stopped the process group's teardown)
        return Signalled(os.getpid(), _signal_received)
    return outcome


def _execute(
    rank: int, local_rank: int, spec: WorkerSpec, payload: Payload | None, conn: Connection | None = None
) -> Outcome:
    """Restore the parent's state, run the function with private arguments, and return the outcome; with
    ``conn``, a generator's values are sent as they are yielded (see :func:`stream_values`)."""
    global _raised, _outcome_decided
    try:
        # devices, CPUs, env=: before anything reads them
        placement.apply(spec, local_rank, rank, environ_made=_environ_made)
        _set_threads(placement.thread_count(spec, local_rank))
        if payload is None:
            payload = _read_payload(spec)
        payload.state.restore()
        function = getattr(payload.function, "_mplaunch_target", payload.function)
        args, kwargs = payload.args, payload.kwargs
        if spec.start_method == "fork" and _must_unshare(spec):  # inherited: what mplaunch mapped is made private
            args, kwargs = unshare((args, kwargs), keep_requested=True)  # what share_memory_() asked stays shared
        with process_group(spec.backend, local_rank):
            try:
                value = function(*args, **kwargs)
                if conn is not None and inspect.isgenerator(value):
                    value = stream_values(value, rank, rank in spec.reporting_ranks, spec, conn, 0)
            except BaseException as error:  # when: before the process group's teardown makes peers fail too
                _raised = (error, time.monotonic())
                raise
        return _decide(Returned(os.getpid(), value if rank in spec.reporting_ranks else None))
    except BaseException as error:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        if _raised is not None and isinstance(error, (Terminated, Interrupted)):
            error = _raised[0]  # the stop landed while the process group was torn down: the function's error first
        if spec.post_mortem and _signal_received is None:
            post_mortem(error, spec, rank)
        # a stop that lands while the error is pickled is noted, not raised there (the record would lose the
        # error's type): _decide weighs it against when the error came
        _outcome_decided = True
        return _decide(Raised.of(error, when=None if _raised is None else _raised[1]))


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Hold the stop signals while a warm rank records a call's error (:meth:`Raised.of`): one that landed
    there would cut the pickling of the error short, and the rank would go on serving calls. It is delivered
    when the block ends, and ends the rank as it would a moment later."""
    held = pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        pthread_sigmask(signal.SIG_SETMASK, held)


def _read_payload(spec: WorkerSpec) -> Payload:
    """The call, mapped copy-on-write from the parent's memory file or from the launch directory."""
    if spec.payload_fd is None:
        payload: Payload = transport.load(
            spec.directory, PAYLOAD, private=True, remove=False, start_objects=spec.start_objects
        )
        return payload
    try:
        payload = transport.load_fd(spec.payload_fd.fd, private=True, start_objects=spec.start_objects)
        return payload
    finally:
        close_quietly(spec.payload_fd.fd)  # the mappings keep what they need


def _keep_own_outcome_fd(spec: WorkerSpec) -> None:
    """Under fork, close the memory files inherited from the parent but this rank's outcome's: the other
    ranks', and those of other launches running in the parent (``submit()``)."""
    if spec.start_method == "fork":
        close_memory_files(set() if spec.outcome_fd is None else {spec.outcome_fd.fd})


#: Values that the standard pickler writes as they are: no storage, buffer or function can be in them.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _dump_outcome(spec: WorkerSpec, name: str | None, outcome: Outcome) -> None:
    """Write the outcome as ``name`` in the launch directory, else (``None``) into this rank's memory file."""
    if name is not None:
        transport.dump(outcome, spec.directory, name)
    else:  # a rank that does not report returns None
        assert spec.outcome_fd is not None
        plain = type(outcome) is Returned and type(outcome.value) in _SCALARS
        transport.dump_fd(outcome, spec.outcome_fd.fd, plain=plain)


def _must_unshare(spec: WorkerSpec) -> bool:
    """Whether a forked worker must look for shared memory in its arguments; for large arguments, the
    parent's answer (see ``WorkerSpec.unshare_pipe``), looking when there is none (the parent failed)."""
    if spec.unshare_pipe is None:
        return spec.unshare is not False
    read_end, write_end = spec.unshare_pipe
    try:
        os.close(write_end)  # the worker's copy: if the parent dies, the read ends
        return os.read(read_end, 1) != b"0"
    finally:
        os.close(read_end)


def _write_outcome(spec: WorkerSpec, rank: int, outcome: Outcome, name: str | None = None) -> Outcome:
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
            transport.remove(spec.directory, name)
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
    signum = outcome.signum if isinstance(outcome, Signalled) else _signal_received
    return 1 if signum is None else 128 + signum


def _finish(spec: WorkerSpec, rank: int, outcome: Outcome | None, *, written: bool = False) -> None:
    """Write the outcome, stop the worker's children, run exit handlers, and leave with the exit status."""
    global _outcome_decided
    _outcome_decided = True
    if outcome is None and _raised is not None:  # a stop landed while the function's error was recorded
        outcome = _decide(Raised.of(_raised[0], when=_raised[1]))  # the error, if it came before the stop
    if outcome is None and _signal_received is not None:  # stopped before the function started
        outcome = Signalled(os.getpid(), _signal_received)
    try:
        if outcome is not None and not written:
            outcome = _write_outcome(spec, rank, outcome)
        _exit_handlers(spec, _exit_code(outcome))
    finally:
        _leave(_exit_code(outcome))


def _leave(code: int) -> NoReturn:
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


def _exit_handlers(spec: WorkerSpec, code: int | None = None) -> None:
    """Run the ``atexit`` handlers while the processes the rank started still run (an experiment tracker
    finishes its run through its helper process), then stop what is left, then multiprocessing's finalizers,
    in the order a normal interpreter exit has them.

    multiprocessing's own exit function joins the rank's non-daemonic children: it runs only once they are
    stopped (:func:`_stop_own_children`, registered first so it runs last), so a child that never ends cannot
    keep the worker. Where the parent's handlers are still registered below it (``code``: the rank is
    leaving with that exit status), that handler also runs the finalizers and ends the rank (:func:`_leave`),
    so that none of the parent's runs.
    """
    global _leaving
    if _parents_exits_kept:
        _leaving = code
    else:
        atexit.unregister(multiprocessing.util._exit_function)  # type: ignore[attr-defined] # (called below)
    atexit._run_exitfuncs()  # the user's, then _stop_own_children
    if not _children_stopped:  # a handler that cleared atexit skipped it
        stop_children(min(1.0, spec.grace_period / 2), kill=True)
    multiprocessing.util._exit_function()  # type: ignore[attr-defined] # finalizers, e.g. semaphores


def _stop_own_children(grace_period: float) -> None:
    """The last ``atexit`` handler of a worker: stop what the rank started and what is still running, SIGKILL
    after ``min(1, grace_period / 2)`` seconds; then, if the rank is leaving with the parent's handlers
    registered below this one, multiprocessing's finalizers and the rank's end (see :func:`_exit_handlers`).
    Does nothing in a process the function forked."""
    global _children_stopped
    if os.getpid() == _worker_pid:
        stop_children(min(1.0, grace_period / 2), kill=True)
        _children_stopped = True
        if _leaving is not None:
            try:
                multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            finally:
                _leave(_leaving)


@dataclasses.dataclass(frozen=True)
class Forked:
    """What the parent makes for one rank just before it forks it (:func:`prepare_forks`), so that the rank
    does not: every page a forked worker writes is copied from the parent's memory first, and each step of
    set-up done once in the parent saves each rank its copies (issue 26).

    Attributes:
        environ: the rank's whole environment, or ``None`` (the rank sets its variables).
        stdin: the stream that becomes its ``sys.stdin`` (:func:`~mplaunch._output.fds.stdin_stream`), or
            ``None`` (it makes its own).
        logging: logging's handlers, which the rank inherits and leaves to the parent.
        groups: whether the parent has a default process group, which the rank inherits and forgets.
        flag: whether the launch has a preemption flag (:mod:`mplaunch._wire.flags`) for the rank to map.
        debugger: what the rank does about ``breakpoint()`` (see :func:`breakpoint_plan`).
    """

    environ: ForkEnviron | None
    stdin: TextIO | None
    logging: InheritedLogging
    groups: bool
    flag: bool
    debugger: BreakpointPlan


def prepare_forks(spec: WorkerSpec, stdin: TextIO | None) -> list[Forked]:
    """In the parent, right before it forks the ranks of ``spec``'s one-node launch: each rank's
    :class:`Forked`. ``stdin``: the stream every rank takes as its ``sys.stdin`` (the caller closes its own
    copy once the ranks are forked)."""
    logging, groups, flag = inherited_logging(), has_groups(), flags.path_if_present(spec.directory)
    shared = _fork_changes(spec, flag)
    own = [_rank_fork_changes(spec, rank) for rank in range(spec.nprocs)]
    made = fork_environs(shared, own)
    environs: list[ForkEnviron | None] = [None] * spec.nprocs if made is None else [*made]
    usual = breakpoint_plan(c_getenv("PYTHONBREAKPOINT"))  # (CPython's breakpoint() reads the C table)
    return [
        Forked(
            environs[rank],
            stdin,
            logging,
            groups,
            flag is not None,
            usual if "PYTHONBREAKPOINT" not in own[rank] else breakpoint_plan(own[rank]["PYTHONBREAKPOINT"]),
        )
        for rank in range(spec.nprocs)
    ]


def _start(
    spec: WorkerSpec, on_interrupt: Callable[[int, Any], None] | None = None, forked: Forked | None = None
) -> None:
    """Signals, parent-death and exit handlers: the first things a worker does. ``on_interrupt``: the
    SIGINT handler instead of the one that ends the worker (a warm worker's, which interrupts a call);
    ``forked``: what the parent made for it before the fork."""
    global _worker_pid, _parents_exits_kept, _leaving
    _worker_pid, _leaving = os.getpid(), None
    for signum in _STOP_SIGNALS:  # one the caller ignores (nohup: SIGHUP) is ignored here too
        ignored = signum in spec.ignored_signals and signum != signal.SIGTERM  # SIGTERM: how a launch stops it
        set_handler(signum, SIG_IGN if ignored else _on_signal)
    if on_interrupt is not None:
        set_handler(signal.SIGINT, on_interrupt)
    if getsignal(signal.SIGCHLD) == SIG_IGN:  # inherited: the rank's children's codes would be lost
        set_handler(signal.SIGCHLD, SIG_DFL)
    _die_with_parent(spec.parent_pid, spec.start_method)
    # the parent's or the fork server's atexit handlers are not the rank's to run. A rank mplaunch forked leaves
    # them registered (letting go of each writes to it: a page copy apiece) and ends before them (_exit_handlers)
    _parents_exits_kept = forked is not None and spec.start_method == "fork"
    if spec.start_method != "spawn" and not _parents_exits_kept:
        atexit._clear()
    atexit.register(_stop_own_children, spec.grace_period)  # first registered: runs after the user's handlers
    if spec.start_method == "fork":
        keep_inherited(None if forked is None else forked.logging)  # the parent's open files are the parent's to flush
        if forked is None or forked.groups:
            forget_inherited_groups()  # the parent's process groups: their threads did not survive the fork
    if spec.start_method != "fork":  # a forked worker has the parent's already
        # a rank's own default is the parent's choice, else the platform's (as in a process torchrun starts)
        multiprocessing.set_start_method(spec.mp_start_method, force=True)
    # the caller's process group, as torch.multiprocessing's workers: in a terminal, the foreground job, so a
    # rank may read and configure the terminal; orphans stay in the worker's tree, which stops it all
    become_subreaper()
    terminal_stdin(None if forked is None else forked.stdin)
    pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked while starting: may raise now


def rank_changes(spec: WorkerSpec, rank: int) -> dict[str, str | None]:
    """The environment changes that make a process rank ``rank`` of ``spec``'s one-node launch: torchrun's
    variables, and ``None`` (removed) for each rank variable of the parent's that they do not set."""
    return replacing(
        rank_environment(
            rank,
            spec.nprocs,
            spec.master_addr,
            spec.master_port,
            agent_store=spec.agent_store,
            restart_count=spec.restart_count,
            max_restarts=spec.max_restarts,
        )
    )


def _fork_changes(spec: WorkerSpec, flag: str | None) -> dict[str, str | None]:
    """The environment changes that every forked rank of ``spec``'s one-node launch gets (each rank's own
    are :func:`_rank_fork_changes`'): torchrun's variables except the three that name the rank, and the
    preemption flag's path (``flag``, when the launch has one)."""
    changes = rank_changes(spec, 0)
    for name in _RANK_OWN:
        del changes[name]
    if flag is not None:
        changes[flags.FLAG_VARIABLE] = flag
    return changes


#: The variables of :func:`rank_changes` whose value is the rank's own.
_RANK_OWN = ("RANK", "LOCAL_RANK", "ROLE_RANK")


def _rank_fork_changes(spec: WorkerSpec, rank: int) -> dict[str, str | None]:
    """Rank ``rank``'s own environment changes, on top of :func:`_fork_changes`': the variables that name the
    rank, its placement's (``CUDA_VISIBLE_DEVICES``, ``env=``'s) and its ``OMP_NUM_THREADS``. A rank would
    set the last two before its function; it finds them set."""
    changes: dict[str, str | None] = {name: str(rank) for name in _RANK_OWN}
    extra = placement.environment(spec, rank)
    changes.update(extra)
    changes["OMP_NUM_THREADS"] = str(placement.planned_threads(spec, rank, placement.threads_in(extra)))
    return changes


def set_up(
    rank: int,
    spec: WorkerSpec,
    on_interrupt: Callable[[int, Any], None] | None = None,
    forked: Forked | None = None,
) -> None:
    """Make this process rank ``rank`` of a one-node launch: signals and parent death (:func:`_start`, which
    takes ``on_interrupt``), the output descriptors, and torchrun's environment. ``forked``: what the parent
    made for this rank before the fork (:func:`prepare_forks`), else it is made here."""
    global _environ_made
    _start(spec, on_interrupt, forked)
    take_fds(spec.output_fds, rank, rank)
    _keep_own_outcome_fd(spec)
    if spec.environ is not None:
        replace_environ(spec.environ)
    _environ_made = forked is not None and forked.environ is not None  # (not a process the rank forked)
    if forked is not None and forked.environ is not None:
        forked.environ.install()
    else:
        apply_environment(os.environ, rank_changes(spec, rank))
    follow_own_rendezvous()  # a rank that sets its own MASTER_PORT (mp.spawn code) gets that rendezvous
    # breakpoint(): one rank at a time, the prompt naming the rank; PYTHONBREAKPOINT as the function will see it
    if forked is not None:
        plan = forked.debugger
    else:
        variable = placement.environment(spec, rank).get("PYTHONBREAKPOINT", os.environ.get("PYTHONBREAKPOINT"))
        plan = breakpoint_plan(variable)
    install_breakpoint_hook(spec, rank, plan)


def run(
    rank: int, spec: WorkerSpec, payload: Payload | None, forked: Forked | None = None, conn: Connection | None = None
) -> None:
    """The target of every launch's worker process: set up the rank, run the function, write the outcome, exit.

    The outcome (the return value for reporting ranks, ``None`` for the others, or the exception) is written
    to the launch directory before the process exits; the parent reads it when it sees the process end.
    ``forked``: what the parent made for this rank before it forked it (:func:`prepare_forks`); ``conn``: the
    rank's end of its pipe, where a generator function's values are announced as they are yielded.
    """
    outcome: Outcome | None = None
    try:
        set_up(rank, spec, forked=forked)
        watch(spec, rank)  # stacks on request, heartbeats, NCCL's flight recorder
        flags.attach(spec.directory, None if forked is None else forked.flag)  # for mplaunch.preempted()
        outcome = _execute(rank, rank, spec, payload, conn)
    except BaseException:  # noqa: BLE001 - a stop that landed while starting: reported by _finish
        pass
    _finish(spec, rank, outcome)


def stream_values(
    generator: Generator[Any, Any, Any], rank: int, reporting: bool, spec: WorkerSpec, conn: Connection, number: int
) -> Any:
    """Send each value ``generator`` yields in rank ``rank`` (where it is ``reporting``) as it comes, as a file
    of the launch directory announced with ``ITEM`` on ``conn``; return its return value."""
    index = 0
    try:
        while True:
            try:
                item = next(generator)
            except StopIteration as stop:
                return stop.value
            if reporting:
                transport.dump(item, spec.directory, item_name(number, rank, index))
                with whole_messages():
                    conn.send((ITEM, number, index))
                index += 1
            del item
    finally:
        generator.close()


@contextlib.contextmanager
def whole_messages() -> Iterator[None]:
    """Hold SIGINT while a message is read or written on a rank's pipe: a ``KeyboardInterrupt`` between the
    reads of a message's length and of its body would leave the pipe out of step. A SIGINT that came
    meanwhile raises when the block ends."""
    previous = pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT,))
    try:
        yield
    finally:
        pthread_sigmask(signal.SIG_SETMASK, previous)


def elastic_entry(spec: WorkerSpec) -> int:
    """The entrypoint of a worker started by ``torch.distributed.elastic`` on one node of a multi-node launch.

    Elastic has set the torchrun environment. The outcome is written to this node's launch directory; rank
    0's is also published in the rendezvous store, where the first worker of every other node fetches it,
    so every node's parent can return rank 0's result. Returns the global rank; a failed worker exits.
    """
    outcome: Outcome | None = None
    written = False
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        _start(spec)
        take_fds(spec.output_fds, local_rank, rank)
        os.environ[WORKER_VARIABLE] = "1"
        install_breakpoint_hook(spec, rank)
        flags.attach(spec.directory)  # this node's preemption flag, if the launch has one: mplaunch.preempted()
        outcome = _execute(rank, local_rank, spec, None)
        if isinstance(outcome, Returned):
            outcome, written = _write_outcome(spec, rank, outcome), True
            _share_rank0(spec, rank, local_rank, outcome)
    except BaseException:  # noqa: BLE001 - a stop that landed outside the function: reported by _finish
        pass
    if not isinstance(outcome, Returned):
        _finish(spec, rank, outcome, written=written)
    _exit_handlers(spec)  # elastic's process then exits normally, with no handler left to run
    return rank


_CONNECT_WAIT = 5.0  # seconds to reach the rendezvous store (c10d may try twice): it answered a moment ago


def _share_rank0(spec: WorkerSpec, rank: int, local_rank: int, outcome: Outcome) -> None:
    """Rank 0 publishes its outcome in the rendezvous store; the first worker of each other node fetches it.

    The fetch waits at most ``spec.result_wait`` seconds, a second at a time, and ends early when the launch
    stops this worker (the agent saw a lost node). Past that wait, or when the store stops answering, the
    node's record of rank 0 is a :class:`~mplaunch.NodeLostError` (rank 0's node is gone, or stuck).
    """
    from datetime import timedelta

    from torch.distributed import DistStoreError, TCPStore  # type: ignore[attr-defined]

    on_first_node = os.environ.get("GROUP_RANK", "0") == "0"
    if rank != 0 and (on_first_node or local_rank != 0 or not isinstance(outcome, Returned)):
        return  # a failed worker does not wait for rank 0: its own failure is what this node reports
    key = f"mplaunch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank0"
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    deadline = time.monotonic() + spec.result_wait
    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=min(_CONNECT_WAIT, spec.result_wait)),
        )
        if rank == 0:
            store.set(key, pickling.to_bytes(outcome))  # type: ignore[arg-type]
            return
        while _signal_received is None and not flags.is_set():  # stopped or preempted: rank 0's value is moot
            try:
                store.wait([key], timedelta(seconds=max(0.01, min(1.0, deadline - time.monotonic()))))
                break
            except DistStoreError:  # this second's wait ended
                if time.monotonic() >= deadline:
                    raise
        else:
            return  # stopped or preempted by the launch: the node's error is the launch's
        shared = pickling.from_bytes(store.get(key))
    except RuntimeError as error:  # torch's DistStoreError / DistNetworkError: a store gone or a wait expired
        if rank == 0:
            raise
        lost = NodeLostError(
            f"rank 0's result did not reach node {os.environ.get('GROUP_RANK')} within {spec.result_wait:g} s "
            f"(the rendezvous store at {address}: {type(error).__name__}: {error}). The node that ran rank 0 "
            "(node 0) is gone, or its store is: its launching process was killed or stopped.",
            0,
            None,
            None,
            address,
        )
        lost.__cause__ = error
        shared = Raised.of(lost)
    transport.dump(shared, spec.directory, REMOTE_RANK0)
