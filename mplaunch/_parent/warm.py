"""Warm workers: :class:`Workers` starts N ranks once and runs many calls on them, keeping their state.

The ranks are started as a launch's are (the same environment, spec, output, rendezvous store, launch
directory and reaper; see :mod:`mplaunch._parent.team`), but each serves calls in a loop
(:mod:`mplaunch._worker.serve`) instead of running one function. The design follows ipyparallel's engines
and Ray's actors (a process that keeps its state between tasks), with mplaunch's one-copy transport.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from typing_extensions import Unpack

from mplaunch._config import LaunchOptions, ParallelConfig, make_config
from mplaunch._errors import InvalidOptionError, LaunchRefusedError
from mplaunch._frames import warn_at_user
from mplaunch._parent import checks, futures, policy
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.directory import space_hint
from mplaunch._parent.exchange import start
from mplaunch._parent.stream import Queued, Stream, ours
from mplaunch._parent.team import Busy, Held, Team
from mplaunch._parent.terminal import terminal_kept
from mplaunch._wire import transport
from mplaunch._wire.importable import worker_imports
from mplaunch._wire.records import Call, RankState, Returned, Stopped, call_name, set_attribute

#: Options of a launch that warm workers do not honour (yet): refused rather than ignored.
_LAUNCH_ONLY = ("stall_timeout", "devices", "cpu_binding", "env", "preempt_signals", "restart_on", "restart_delay")


class Workers:
    """``nprocs`` ranks started once and kept: each :meth:`run` runs a function on every rank of them.

    The ranks see torchrun's environment, as a launch's do; with ``backend`` set, the process group is
    initialised once, when they start, and kept. What a rank keeps between calls persists: its module
    globals (``global model``), the objects they hold, a CUDA context, the process group. A function
    defined after the ranks started (a re-run notebook cell) reaches them by value.

    Closing (:meth:`close`, the end of a ``with`` block), garbage collection, the interpreter's exit (also a
    notebook kernel's shutdown or restart) and the death of this process end the ranks and remove what they
    used (processes, shared memory, descriptors).

    Args:
        return_all: :meth:`run` returns every rank's value, in a list ordered by rank.
        **options: the launch options of :func:`~mplaunch.parallel` (``nprocs``, ``start_method``, ``backend``,
            ``timeout`` (seconds per call), ``rdzv_timeout`` (seconds the ranks may take to start and join
            their process group, apart from the first call's ``timeout``), ``grace_period``,
            ``prefix_output``, ``console_ranks``, ``log_dir``, ``post_mortem``); ``nnodes`` > 1,
            ``max_restarts`` and the options of launches only (``stall_timeout``, ``devices``, ``cpu_binding``,
            ``env``, ``preempt_signals``, ``restart_on``, ``restart_delay``) are refused.

    Raises:
        InvalidOptionError: an option is invalid, or refused here (``console_ranks`` naming no rank too).
        LaunchRefusedError: a check before starting failed (main guard, CUDA before fork).

    Example:
        >>> with mplaunch.Workers(nprocs=2, backend="gloo") as workers:  # doctest: +SKIP
        ...     workers.run(load_model, "resnet18")
        ...     loss = workers.run(train_epoch, lr=0.1)
    """

    def __init__(self, *, return_all: bool = False, **options: Unpack[LaunchOptions]) -> None:
        __tracebackhide__ = True  # noqa: F841
        config = make_config(return_all=return_all, **options)
        self._setup(config, sys._getframe(1))

    @classmethod
    def _of(cls, config: ParallelConfig, frame: Any) -> Workers:
        """Workers with an already validated configuration (a generator function's launch)."""
        workers = cls.__new__(cls)
        workers._setup(config, frame)
        return workers

    def _setup(self, config: ParallelConfig, frame: Any) -> None:
        if config.max_restarts:
            raise InvalidOptionError(
                f"max_restarts={config.max_restarts} is not valid for Workers: the next run() starts again the "
                "ranks that failed. Pass 0."
            )
        defaults = {field.name: field.default for field in dataclasses.fields(ParallelConfig)}
        for name in _LAUNCH_ONLY:
            if name in defaults and getattr(config, name) != defaults[name]:
                raise InvalidOptionError(
                    f"{name}={getattr(config, name)!r} is not valid for Workers: it applies to launches "
                    f"(@parallel) only. Leave it out (default {defaults[name]!r})."
                )
        if config.nnodes is not None and config.nnodes > 1:
            raise InvalidOptionError(f"nnodes={config.nnodes} is not valid for Workers: they run on one node. Pass 1.")
        nprocs = policy.resolve_nprocs(config.nprocs)
        if config.console_ranks is not None and not any(rank < nprocs for rank in config.console_ranks):
            raise InvalidOptionError(
                f"console_ranks={sorted(config.console_ranks)} names no rank of these workers (ranks 0 to "
                f"{nprocs - 1}), so no output would reach the console: pick ranks below {nprocs}."
            )
        checks.check_not_bootstrapping("Workers")
        checks.check_log_dir(config.log_dir)
        self.config = config
        self.nprocs = nprocs
        self.start_method = config.start_method or policy.default_start_method()
        checks.check_cuda_fork(self.start_method)
        checks.check_main_guard(self.start_method, frame, "Workers")
        config = dataclasses.replace(config, post_mortem=checks.post_mortem_terminal(config.post_mortem))
        self.config = config
        self._numbers = itertools.count()
        self._held = held = Held()
        self._finalizer = weakref.finalize(self, held.close)
        self._finalizer.atexit = False  # _close_all does it, in the right order
        held.team = Team(config, self.nprocs, self.start_method)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank (empty once closed)."""
        team = self._held.team
        return [] if team is None else [p.pid for p in team.processes if p.pid is not None]

    def run(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every rank and return rank 0's value.

        ``function`` may be a plain function or a decorated one (its plain function runs). A generator
        function returns at once a :class:`~mplaunch.Stream` of the values rank 0 yields, as they are
        yielded. One call runs at a time: a call from another thread waits; a call from the thread that
        left a stream unfinished closes that stream first.

        Ctrl-C stops the call in every rank (``KeyboardInterrupt`` at the line it runs) and keeps the ranks.
        A rank that does not stop within ``grace_period`` seconds is stopped with the others, and the next
        call starts them all again.

        Returns:
            Rank 0's value (every rank's, in a list, with ``return_all=True``), or a ``Stream``.

        Raises:
            BaseException: the first failure of a rank, as a launch raises it (the worker's exception as
                itself, with ``rank``, ``pid`` and ``failures``). The ranks still running the call are
                interrupted; those that died are started again by the next call, with a ``RuntimeWarning``
                that their state was lost.
            LaunchRefusedError: the function or an argument cannot be sent to the ranks.
            LaunchTimeoutError: the call ran past ``timeout`` seconds; it was interrupted. Or the ranks did
                not finish starting within ``rdzv_timeout`` seconds; they were stopped.
            KeyboardInterrupt: Ctrl-C; the call was interrupted.
            RuntimeError: the workers are closed, or this process was forked from the one that made them.
            TypeError: ``function`` is not callable, or the arguments do not fit its signature (checked
                here, before the call is sent to the ranks).
        """
        __tracebackhide__ = True  # noqa: F841
        target = _checked(function, args, kwargs)
        try:
            if inspect.isgeneratorfunction(target):
                return self._stream(target, args, kwargs)
            return self._call(target, args, kwargs, None)
        except BaseException as error:
            if not ours(error):
                raise
            raise error.with_traceback(None) from error.__cause__

    def submit(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.LaunchFuture[Any]:
        """Run the call in the background; return a :class:`concurrent.futures.Future` of what :meth:`run`
        returns or raises. ``cancel()`` interrupts the call (not the ranks).

        For a generator function, the future is of its return value, and its ``items`` attribute iterates
        over the values yielded (as :meth:`run`'s stream), as they arrive.

        Returns:
            The future.

        Raises:
            RuntimeError: this process was forked from the one that made these workers.
            TypeError: as for :meth:`run`.
        """
        self._held.check_process()
        target = _checked(function, args, kwargs)
        control = LaunchControl(stoppable=True)
        name = getattr(target, "__qualname__", "call")
        if not inspect.isgeneratorfunction(target):
            return futures.submit(lambda control: self._call(target, args, kwargs, control), control, name)
        items: Queued[Any] = Queued()

        def run(control: LaunchControl) -> Any:
            try:
                stream = self._stream(target, args, kwargs, control)
                items.feed(stream)
                return stream.value
            finally:
                items.end()

        future = futures.submit(run, control, name)
        future.items = items  # type: ignore[attr-defined]
        return future

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

    def _busy(self) -> Any:
        """Hold the call lock (see :meth:`run`)."""
        held = self._held
        held.check_process()  # before the lock: a thread of the owner may have held it at the fork
        stream = None if held.stream is None else held.stream()
        if held.owner is threading.current_thread() and stream is not None:
            warn_at_user("mplaunch.Workers: the unfinished stream of the previous call was closed", RuntimeWarning)
            stream.close()
        return Busy(held)

    def _team(self) -> Team:
        """The ranks for the next call: started again (with a warning) if any died or was stopped."""
        held = self._held
        if held.closed:
            raise RuntimeError("these mplaunch.Workers are closed: make new ones")
        team = held.team
        if team is None or not team.alive():
            if team is not None:
                team.close()
            held.team = None
            warn_at_user(
                "mplaunch.Workers: ranks had died or were stopped; all ranks were started again, and the state "
                "they held (globals, models, the process group) is lost",
                RuntimeWarning,
            )
            team = held.team = Team(self.config, self.nprocs, self.start_method)
        return team

    def _send(self, team: Team, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Write the call for the ranks; return its number."""
        number = next(self._numbers)
        fork = self.start_method == "fork"
        imports = None if fork else worker_imports()
        try:
            transport.dump(
                Call(function, args, kwargs, getattr(getattr(function, "__code__", None), "co_filename", None)),
                team.spec.directory,
                call_name(number),
                by_value=fork,
                imports=imports,
            )
        except OSError as error:
            raise LaunchRefusedError(
                f"cannot write the call's arguments: {error}. {space_hint(team.spec.directory)}"
            ) from error
        except Exception as error:
            culprit = checks.describe_unpicklable(args, kwargs, imports, function)
            raise LaunchRefusedError(
                f"cannot send the call to the ranks: {culprit}. Pass picklable values, or create the object "
                "inside the function."
            ) from error
        return number

    def _call(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: LaunchControl | None) -> Any:
        with self._busy(), terminal_kept():
            team = self._team()
            number = self._send(team, function, args, kwargs)
            calling = start(team, number, None if control is None else control.fileno(), self.config.timeout)
            if control is not None:
                control.stacks_source = team.stacks  # future.stacks() while the call runs
            try:
                states = _returned(calling)
            finally:
                if control is not None:
                    control.stacks_source = None
            return self._outcome(team, states)

    def _stream(
        self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: LaunchControl | None = None
    ) -> Stream[Any]:
        busy = self._busy()
        busy.__enter__()
        try:
            team = self._team()
            number = self._send(team, function, args, kwargs)
            calling = start(team, number, None if control is None else control.fileno(), self.config.timeout)

            def ended() -> None:
                if control is not None:
                    control.stacks_source = None
                busy.__exit__(None, None, None)

            if control is not None:
                control.stacks_source = team.stacks  # future.stacks() while the call runs
            stream: Stream[Any] = Stream(
                calling, lambda states: self._outcome(team, states), ended, self.config.return_all
            )
        except BaseException:
            if control is not None:
                control.stacks_source = None
            busy.__exit__(None, None, None)
            raise
        self._held.stream = weakref.ref(stream)
        return stream

    def _outcome(self, team: Team, states: dict[int, RankState]) -> Any:
        """The call's value from each rank's state, or its first failure raised."""
        if team.broken and self._held.team is team:
            team.close()  # the next call starts new ranks
        failures = {rank: s for rank, s in states.items() if isinstance(s, BaseException)}
        if failures:
            first = min(failures, key=lambda r: (team.failed_at.get(r, float("inf")), r))
            failure = failures.pop(first)
            set_attribute(failure, "failures", tuple(failures[r] for r in sorted(failures)))
            raise failure
        if any(isinstance(s, Stopped) for s in states.values()):
            raise RuntimeError("the call was stopped: the workers were closed while it ran")
        values = [s.value if isinstance(s, Returned) else None for _, s in sorted(states.items())]
        return values if self.config.return_all else values[0]


def _returned(exchange: Any) -> Any:
    """Run ``exchange`` to its end and return its return value."""
    while True:
        try:
            next(exchange)
        except StopIteration as stop:
            return stop.value


def _checked(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The plain function a call of :meth:`Workers.run` or :meth:`Workers.submit` runs, its arguments checked
    against its signature here, as a launch checks them.

    Raises:
        TypeError: ``function`` is not callable, or the arguments do not fit it (as a plain call would say).
    """
    target = getattr(function, "_mplaunch_target", function)
    if not callable(target):
        raise TypeError(
            f"Workers.run() and submit() take the function to run on every rank first, not {function!r}: "
            "pass a function, then its arguments, e.g. workers.run(train_epoch, 0.1)."
        )
    checks.check_arguments(target, args, kwargs, before="sending the call to the ranks")
    return target
