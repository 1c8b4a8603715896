"""Warm workers: :class:`Workers` starts N ranks once (a launch's spec, store, directory and
:class:`~mplaunch._parent.ranks.Ranks`) that serve calls (:mod:`mplaunch._worker.serve`): a call is written once to
the launch directory, each rank is told on its pipe, runs it in its main thread and answers there. Follows
ipyparallel's engines and Ray's actors (a process keeps its state between tasks), with mplaunch's transport."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any

from typing_extensions import Unpack

from mplaunch._config import LaunchOptions, ParallelConfig, call_config, check_mode, make_config
from mplaunch._errors import LaunchRefusedError, raised_by_design
from mplaunch._frames import warn_at_user
from mplaunch._parent import checks, devices, futures, policy
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.directory import launch_directory, log_dir_held, space_hint
from mplaunch._parent.launch import captured_state, check_console_ranks, drained, launch_spec, new_ranks
from mplaunch._parent.memfiles import payload_written
from mplaunch._parent.outcomes import RankState, Stopped
from mplaunch._parent.preemption import preemption_notice
from mplaunch._parent.ranks import Ranks, board_for, values
from mplaunch._parent.signalling import signal_worker
from mplaunch._parent.starter import in_starter
from mplaunch._parent.store import rendezvous
from mplaunch._parent.stream import Stream
from mplaunch._parent.terminal import terminal_kept
from mplaunch._parent.usage import live_usage
from mplaunch._platform import forks
from mplaunch._platform.proctree import takes_signal
from mplaunch._reports import RankReport, RunReport
from mplaunch._wire import flags, transport
from mplaunch._wire.importable import worker_imports
from mplaunch._wire.records import EXIT, Call, Payload, call_name
from mplaunch._worker.serve import serve


class Workers:
    """``nprocs`` ranks started once and kept: each [`run()`][mplaunch.Workers.run] runs a function on every
    rank.

    The ranks see torchrun's environment, as a launch's do; with ``backend`` set, the process group is
    initialised once, when they start, and kept. What a rank keeps between calls persists: its module
    globals (``global model``), the objects they hold, a CUDA context, the process group. A function
    defined after the ranks started (a re-run notebook cell) reaches them by value.

    Closing ([`close()`][mplaunch.Workers.close], the end of a ``with`` block), garbage collection, the interpreter's
    exit (also a notebook kernel's shutdown or restart) and the death of this process end the ranks and remove what they
    used (processes, shared memory, descriptors).

    Args:
        return_all: [`run()`][mplaunch.Workers.run] returns every rank's value, in a list ordered by rank.
        **options: the launch options of [`parallel()`][mplaunch.parallel]. Those that place the ranks (``nprocs``,
            ``start_method``, ``backend``, ``devices``, ``cpu_binding``, ``env``, output, ``log_dir``) apply when they
            start; ``timeout``, ``stall_timeout``, ``preempt_signals`` and ``preempt_grace`` apply to each call;
            ``rdzv_timeout`` bounds the ranks' start, apart from the first call's ``timeout``. ``max_restarts``,
            ``restart_on``, ``restart_delay`` and ``nnodes`` > 1 are refused (see the options reference's table).

    Attributes:
        last_report: the [`RunReport`][mplaunch.RunReport] of the last call that ended, else ``None``: each rank's
            peak memory, and the CPU and wall time the call took.

    Raises:
        InvalidOptionError: an option is invalid, or refused here (``console_ranks`` naming no rank too).
        LaunchRefusedError: a check before starting failed (main guard, CUDA before fork).

    Example:
        ```python title="Fragment: load_model() and train_epoch() are yours"
        with mplaunch.Workers(nprocs=2, backend="gloo") as workers:
            workers.run(load_model, "resnet18")  # each rank keeps the model
            loss = workers.run(train_epoch, lr=0.1)
        ```
    """

    last_report: RunReport | None = None

    def __init__(self, *, return_all: bool = False, **options: Unpack[LaunchOptions]) -> None:
        __tracebackhide__ = True  # noqa: F841
        self.config = config = make_config(return_all=return_all, **options)
        check_mode(config, "Workers(...)")
        checks.check_not_bootstrapping("mplaunch.Workers")
        checks.check_log_dir(config.log_dir)
        devices.check_request(config.devices)
        self.start_method = config.start_method or policy.default_start_method()
        checks.check_cuda_fork(self.start_method)
        checks.check_main_guard(self.start_method, sys._getframe(1), "mplaunch.Workers")
        if isinstance(config.nprocs, int) or config.devices is None:
            self.nprocs = policy.resolve_nprocs(config.nprocs)  # "auto" as a launch counts
        else:  # "auto" with devices: their number
            self.nprocs = config.devices if isinstance(config.devices, int) else len(config.devices)
        check_console_ranks(config, self.nprocs, "these workers")
        self._numbers = itertools.count()
        self._held = held = Held()
        self._finalizer = weakref.finalize(self, held.close)
        self._finalizer.atexit = False  # _close_all does it, in the right order
        held.team = Team(config, self.nprocs, self.start_method)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank (empty once closed)."""
        team = self._held.team
        return [] if team is None else list(team.ranks.pids)

    def run(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every rank and return rank 0's value.

        ``function`` may be a plain function or a decorated one (its plain function runs). A generator function returns
        at once a [`Stream`][mplaunch.Stream] of the values rank 0 yields, as they are yielded. One call runs at a time,
        in the order made (``run()``, ``submit()``, any thread); a call from a thread that left a stream open closes it.

        Ctrl-C stops the call in every rank (``KeyboardInterrupt`` at the line it runs) and keeps the ranks.
        A rank that does not stop within ``grace_period`` seconds is stopped with the others, and the next
        call starts them all again.

        Returns:
            Rank 0's value (every rank's, in a list, with ``return_all=True``), or a ``Stream``.

        Raises:
            BaseException: the first failure of a rank, as a launch raises it (the worker's exception as itself, with
                ``rank``, ``pid`` and ``failures``). The ranks still running the call are interrupted; those that died
                are started again by the next call, with a ``RuntimeWarning`` that their state was lost.
            LaunchRefusedError: the function or an argument cannot be sent to the ranks.
            LaunchTimeoutError: the call ran past ``timeout`` seconds; it was interrupted, and the error carries each
                rank's stacks. Or the ranks did not finish starting within ``rdzv_timeout`` seconds; they were stopped.
            StallError: a rank that called [`heartbeat()`][mplaunch.heartbeat] in the call stopped calling it for
                ``stall_timeout`` seconds; the call was interrupted.
            PreemptedError: one of ``preempt_signals`` came during the call (see [`parallel()`][mplaunch.parallel]).
            KeyboardInterrupt: Ctrl-C; the call was interrupted.
            RuntimeError: the workers are closed, or this process was forked from the one that made them.
            TypeError: ``function`` is not callable, or the arguments do not fit its signature (checked
                here, before the call is sent to the ranks).
        """
        __tracebackhide__ = True  # noqa: F841
        call, config = self._checked(function, args, kwargs)
        try:
            if inspect.isgeneratorfunction(call.function):
                return self._stream(call, config)
            return self._call(call, config, None)
        except BaseException as error:
            if not raised_by_design(error):
                raise
            raise error.with_traceback(None) from error.__cause__

    def submit(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.LaunchFuture[Any]:
        """Run the call in the background; return a ``concurrent.futures.Future`` of what
        [`run()`][mplaunch.Workers.run] returns or raises. ``cancel()`` interrupts the call (not the ranks), or takes it
        out of the queue; ``report`` is its [`RunReport`][mplaunch.RunReport] once it has ended. Calls run in the order
        made, ``run()``'s too: first in, first out, as a one-thread executor's tasks or one caller's Ray actor calls.

        For a generator function, the future is of its return value, and its ``items`` attribute iterates
        over the values yielded (as [`run()`][mplaunch.Workers.run]'s stream), as they arrive.

        Returns:
            The future.

        Raises:
            RuntimeError: this process was forked from the one that made these workers.
            TypeError: as for [`run()`][mplaunch.Workers.run].
        """
        self._held.check_process(self)
        call, config = self._checked(function, args, kwargs)
        check_mode(config, "submit()", "Workers.submit()")
        control = LaunchControl(stoppable=True)
        name = getattr(call.function, "__qualname__", "call")
        turn = next(self._held.turns)  # here, in the caller's thread: its place in the queue
        try:  # (a thread that cannot start must not leave its turn waited for forever)
            if inspect.isgeneratorfunction(call.function):
                return futures.submit_stream(lambda control: self._stream(call, config, control, turn), control, name)
            return futures.submit(lambda control: self._call(call, config, control, turn), control, name)
        except BaseException:
            self._held.give_up(turn)
            raise

    def close(self) -> None:
        """Tell the ranks to leave (their exit handlers run), stop those still running after
        ``grace_period`` seconds, and remove everything they used. Idempotent."""
        self._finalizer()

    def restart(self) -> None:
        """Stop the ranks and start new ones (their state is lost), e.g. after a collective was interrupted."""
        with self._busy():
            held = self._held
            if held.team is not None:
                held.team.close()
            held.team = Team(self.config, self.nprocs, self.start_method)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._held.closed else f"pids {self.pids}"
        return f"<mplaunch.Workers nprocs={self.nprocs} start_method={self.start_method!r}, {state}>"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} cannot be sent to another process, its own ranks included: call it only in the process "
            f"that made it (pid {self._held.pid}), not from a function it runs"
        )

    def _checked(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Call, ParallelConfig]:
        """Return the call of the plain function, its arguments checked, and its options (a decorated
        function's own merged in, see :func:`~mplaunch._config.call_config`, which refuses those that differ)."""
        target = getattr(function, "_mplaunch_target", function)
        if not callable(target):
            raise TypeError(
                f"Workers.run() and submit() take the function to run on every rank first, not {function!r}: "
                "pass a function, then its arguments, e.g. workers.run(train_epoch, 0.1)."
            )
        checks.check_arguments(target, args, kwargs, before="sending the call to the ranks")
        call = Call(target, args, kwargs, getattr(getattr(target, "__code__", None), "co_filename", None))
        own = getattr(function, "config", None)
        if target is function or not isinstance(own, ParallelConfig):
            return call, self.config
        return call, call_config(own, self.config, getattr(function, "__name__", "the function"))

    def _busy(self, turn: int | None = None, control: LaunchControl | None = None) -> Held:
        """Close this thread's open stream; wait for ``turn`` (default: the next); return ``Held`` (exit ends it)."""
        held = self._held
        held.check_process(self)  # before the lock: a thread of the owner may have held it at the fork
        stream = None if held.stream is None else held.stream()
        if held.owner is threading.current_thread() and stream is not None:
            warn_at_user("mplaunch.Workers: the unfinished stream of the previous call was closed", RuntimeWarning)
            stream.close()
        held.wait_turn(next(held.turns) if turn is None else turn, control)
        return held

    def _send(self, call: Call) -> tuple[Team, int]:
        """Write the call for the ranks (started again, with a warning, if one died); return them and its number."""
        held = self._held
        if held.closed:
            raise RuntimeError("these mplaunch.Workers are closed: make new ones")
        team = held.team
        if team is None or not team.ranks.alive():
            if team is not None:
                team.close()
            held.team = None
            if lost := team is not None and bool(team.ranks.ready):  # (ranks that died starting held no state)
                warn_at_user(
                    "mplaunch.Workers: ranks had died or were stopped; all ranks were started again, and the state "
                    "they held (globals, models, the process group) is lost",
                    RuntimeWarning,
                )
            team = held.team = Team(self.config, self.nprocs, self.start_method)
            team.state_lost = lost
        number = next(self._numbers)
        fork = self.start_method == "fork"
        imports = None if fork else worker_imports()
        directory = team.ranks.spec.directory
        try:
            transport.dump(call, directory, call_name(number), by_value=fork, imports=imports)
        except OSError as error:
            raise LaunchRefusedError(f"cannot write the call's arguments: {error}. {space_hint(directory)}") from error
        except Exception as error:
            culprit = checks.describe_unpicklable(call.args, call.kwargs, imports, call.function, by_value=fork)
            raise LaunchRefusedError(
                f"cannot send the call to the ranks: {culprit}. Pass picklable values, or create the object "
                "inside the function."
            ) from error
        return team, number

    def _exchange(
        self, team: Team, number: int, config: ParallelConfig, control: LaunchControl
    ) -> Generator[tuple[int, Any], None, Any]:
        """Run call ``number`` on ``team``'s ranks, as :meth:`Ranks.call`; return its value (or values)."""
        ranks = team.ranks
        before = [live_usage(process.pid) for process in ranks.processes]
        started = time.monotonic()
        states: dict[int, RankState] = {}
        if ranks.pump is not None:
            ranks.pump.retarget()  # this call's output goes where the caller's would (its notebook cell)
        try:
            with preemption_notice(control, ranks.spec.directory, config.preempt_signals, config.preempt_grace):
                states = yield from ranks.call(
                    number, control, config.timeout, config.stall_timeout, config.rdzv_timeout, config.return_all
                )
        except BaseException as error:
            if team.state_lost and hasattr(error, "add_note"):  # its first failure: maybe of what is gone
                error.add_note(_LOST)
            team.state_lost = False
            raise
        finally:
            report = RunReport((), time.monotonic() - started)
            if os.getpid() == ranks.pid and not team.closed:  # (closed by another thread, or at exit)
                team.clean(number)
                if ranks.pump is not None:
                    ranks.pump.sync()  # the call's output before its value
                report = _call_report(ranks, before, states, report.wall_time)
                if ranks.broken and self._held.team is team:
                    team.close()  # the next call starts new ranks
            self.last_report = control.report = report
        if any(isinstance(state, Stopped) for state in states.values()):
            raise RuntimeError("the call was stopped: the workers were closed while it ran")
        found = values(states, ranks.spec.nprocs)
        return found if config.return_all else found[0]

    def _call(self, call: Call, config: ParallelConfig, control: LaunchControl | None, turn: int | None = None) -> Any:
        with self._busy(turn, control), terminal_kept():
            team, number = self._send(call)
            return drained(self._exchange(team, number, config, control or LaunchControl()))

    def _stream(
        self, call: Call, config: ParallelConfig, control: LaunchControl | None = None, turn: int | None = None
    ) -> Stream[Any]:
        busy = self._busy(turn, control)
        try:
            team, number = self._send(call)
            calling = self._exchange(team, number, config, control or LaunchControl())
        except BaseException:
            busy.release()
            raise
        stream: Stream[Any] = Stream(calling, busy.release, config.return_all)
        stream.prime()  # the ranks run the call whether or not its values are read (a failure ends the stream)
        self._held.stream = weakref.ref(stream)
        return stream


class Team:
    """Warm ranks (their :class:`Ranks`) and what lives as long: directory, store, pump, board, devices, flag."""

    def __init__(self, config: ParallelConfig, nprocs: int, start_method: str) -> None:
        self.pid = os.getpid()  # the owner: in a process forked from it, the team is a copy that acts on nothing
        self.closed = False
        self.state_lost = False  # started again in place of ranks that died: what earlier calls left is gone
        with contextlib.ExitStack() as stack:  # (all of it closed if the start fails)
            names = stack.enter_context(devices.held(config.devices, LaunchControl()))
            directory = stack.enter_context(launch_directory())
            stack.enter_context(log_dir_held(config.log_dir))
            call = Payload(None, (), {}, captured_state(start_method == "fork"))  # type: ignore[arg-type]
            written = None
            if start_method != "fork":
                written = stack.enter_context(
                    payload_written(call, directory, start_method, worker_imports(), memory=True)
                )
            board = stack.enter_context(board_for(directory, nprocs, True))  # a call may bring its stall_timeout
            stack.callback(flags.create(directory).close)  # for mplaunch.preempted(): raised by a call's notice
            spec = launch_spec(
                config, directory, nprocs, start_method, names, stacks=True, board=board is not None, payload=written
            )
            store = stack.enter_context(rendezvous(lazy=spec.backend is None))  # a group is joined at the start
            ranks = new_ranks(stack, spec, store, board, warm=True)
            stack.callback(ranks.close)
            pipes = [multiprocessing.Pipe(duplex=True) for _ in range(nprocs)]
            in_starter(lambda: ranks.start(serve, call if start_method == "fork" else None, [], pipes))
            self.ranks = ranks
            self._stack = stack.pop_all()

    def clean(self, number: int) -> None:
        """Remove what call ``number`` left in the launch directory (values nobody read, the call)."""
        directory = self.ranks.spec.directory
        prefixes = tuple(f"{dot}{kind}{number}{end}" for dot in ("", ".") for kind, end in _CALL_FILES)
        with contextlib.suppress(OSError):
            for entry in os.listdir(directory):
                if entry == "post-mortem" or entry.startswith(prefixes):  # (the next call's failure may debug)
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, entry))

    def close(self) -> None:
        """Tell the ranks to leave, stop any left after ``grace_period`` s, remove all; idempotent (a fork: a copy)."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.pid:
            return
        ranks = self.ranks
        ranks.closing = True
        for conn in ranks.conns:
            with contextlib.suppress(OSError):
                conn.send((EXIT,))
        for rank in range(len(ranks.processes)):  # a call that runs is interrupted; a rank still starting (SIGINT
            if rank in ranks.ready or takes_signal(ranks.pids[rank], signal.SIGINT, True):  # held) would die of it
                signal_worker(ranks.processes[rank], signal.SIGINT)
        try:
            ranks.stop(None)  # their own exit first (finally blocks, exit handlers); SIGKILL after the grace period
        finally:
            self._stack.close()


_LOST = "mplaunch.Workers: the ranks were started again before this call (some had died or were stopped), so what \
earlier calls left in them (globals, models, the process group) is gone: run those calls again first."
_CALL_FILES = (("call", "."), ("item", "-"), ("result", "-"))  # call{N}., item{N}-, result{N}-


def _call_report(ranks: Ranks, before: list[tuple[int, float, float] | None], states: Any, wall: float) -> RunReport:
    """Return a warm call's report: peak memory so far, the call's CPU time (a rank that died: its whole account)."""
    ended = {report.rank: report for report in ranks.report(states)}
    found = []
    for rank, process in enumerate(ranks.processes):
        if rank in ranks.exits:
            found.append(ended[rank])
            continue
        now, then = live_usage(process.pid), before[rank] if rank < len(before) else None
        found.append(
            RankReport(
                rank=rank,
                pid=process.pid,
                exitcode=None,
                signal_name=None,
                max_rss=None if now is None else now[0],
                user_time=None if now is None or then is None else now[1] - then[1],
                system_time=None if now is None or then is None else now[2] - then[2],
                wall_time=wall,
                oom=False,
            )
        )
    return RunReport(tuple(found), wall)


class Held:
    """What a :class:`~mplaunch.Workers` owns apart from it: its team, and its calls' queue (a ticket lock)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process whose ranks these are: a process forked from it has copies only
        self.team: Team | None = None
        self.closed = False
        self.turns = itertools.count()  # (next() is atomic)
        self.changed = threading.Condition()
        self.serving = 0  # the turn of the call that runs or is next
        self.given_up: set[int] = set()  # later turns whose calls left the queue (cancelled, interrupted)
        self.owner: threading.Thread | None = None  # the thread whose call has its turn
        self.stream: weakref.ref[Stream[Any]] | None = None  # its stream; weak: one dropped after a `break` closes
        _open.add(self)
        _register_exit()

    def close(self) -> None:
        """Close the team, for good. Idempotent."""
        self.closed = True
        team, self.team = self.team, None
        if team is not None:
            team.close()  # in a process forked from the owner, a copy: it leaves the owner's ranks alone

    def check_process(self, workers: Workers) -> None:
        """Raise ``RuntimeError`` naming ``workers`` in a process forked from the one that made them (their rank)."""
        advice = "Call them there; in one of their ranks, call the function itself."
        forks.check_owner(self.pid, f"{workers!r} and their ranks", advice)

    def wait_turn(self, turn: int, control: LaunchControl | None = None) -> None:
        """Wait until ``turn`` comes; a stop of ``control`` (``LaunchStopped``) or Ctrl-C gives it up."""
        with self.changed:
            try:
                while self.serving != turn:
                    if control is not None:
                        control.check()
                    self.changed.wait(0.05 if control is not None else None)  # (a stop writes to no condition)
            except BaseException:
                self.give_up(turn)
                raise
        self.owner = threading.current_thread()

    def give_up(self, turn: int) -> None:
        """End ``turn`` (or leave the queue before it came); the next turn still waiting comes."""
        with self.changed:
            self.given_up.add(turn)
            while self.serving in self.given_up:
                self.given_up.discard(self.serving)
                self.serving += 1
            self.changed.notify_all()

    def __enter__(self) -> None:
        pass  # the turn was taken by Workers._busy

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """End the running call's turn."""
        self.owner = None
        self.stream = None
        self.give_up(self.serving)


_open: weakref.WeakSet[Held] = weakref.WeakSet()


@functools.cache  # once per process
def _register_exit() -> None:
    atexit.register(_close_all)  # after multiprocessing's handler, so it runs first (last in, first out)


def _close_all() -> None:
    """Close every open set of warm workers, at exit, before ``multiprocessing`` joins its children."""
    Stream._at_exit = True
    for held in list(_open):
        held.close()
