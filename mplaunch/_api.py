"""``parallel()`` and the function object it returns."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, overload

from typing_extensions import ParamSpec, Unpack

from mplaunch._config import LaunchOptions, ParallelConfig, make_config, replace_options
from mplaunch._errors import InvalidOptionError, raised_by_design
from mplaunch._frames import named_original, resolve, user_frame
from mplaunch._parent import futures, in_process, launch
from mplaunch._parent.control import LaunchControl
from mplaunch._reports import RunReport
from mplaunch._state.snapshot import GlobalState, for_launch

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class ParallelFunction(Generic[P, T]):
    """A function that, when called, runs on ``nprocs`` worker processes and returns rank 0's value.

    Made by [`parallel()`][mplaunch.parallel], with the wrapped function's signature, ``__name__``, ``__qualname__``,
    ``__module__`` and ``__doc__``; ``__wrapped__`` is the plain function. It pickles by reference (module and qualified
    name), so ``spawn`` and ``forkserver`` workers find it by importing its module, without launching again.
    [`debug()`][mplaunch.ParallelFunction.debug] runs it here as rank 0 of a world of 1 with a worker's setup, for
    debuggers; [`submit()`][mplaunch.ParallelFunction.submit] launches in the background;
    [`options()`][mplaunch.ParallelFunction.options] returns a copy with some options replaced.

    Attributes:
        config: the validated launch options ([`ParallelConfig`][mplaunch.ParallelConfig]).
        last_report: the [`RunReport`][mplaunch.RunReport] of this object's last call that ended (returned or raised),
            else ``None``; a submitted launch's is ``future.report``.
    """

    last_report: RunReport | None = None
    __wrapped__: Callable[P, Any]
    __name__: str
    __qualname__: str

    def __init__(self, function: Callable[P, Any], config: ParallelConfig) -> None:
        functools.update_wrapper(self, function)
        self.config: ParallelConfig = config

    @property
    def _mplaunch_target(self) -> Callable[P, Any]:
        return self.__wrapped__

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        """Bind a decorated method to ``instance`` (see ``BoundParallelMethod``)."""
        return self if instance is None else BoundParallelMethod(self, instance)

    def __call__(self, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Start the workers, run the function in each with these arguments, wait, and return the result.

        Returns:
            Rank 0's return value with every tensor on the CPU, or, with ``return_all=True``, a list of every rank's
            value ordered by rank. For a generator function, at once a [`Stream`][mplaunch.Stream]: an iterator (and
            async iterator) over the values rank 0 yields, as they are yielded (``(rank, value)`` pairs from every
            rank with ``return_all=True``); the workers stop when it ends or is closed (guide: "Interactive work").

        Raises:
            BaseException: the exception a worker raised, as its own type, with ``rank`` and ``pid`` attributes and
                the worker's traceback as ``__cause__``; ``failures`` holds other ranks' failures and
                ``earlier_attempts`` those of earlier attempts (``max_restarts``), oldest first.
            LaunchRefusedError: a check before launching failed (main guard, CUDA before fork, an argument that
                cannot be pickled under spawn/forkserver); no worker was started.
            WorkerExitedError: a worker was killed, exited non-zero, or exited without returning.
            RemoteError: a worker's exception or result could not be pickled or unpickled.
            LaunchTimeoutError: the launch ran past ``timeout`` seconds; it carries each rank's stacks.
            StallError: a rank stopped calling [`heartbeat()`][mplaunch.heartbeat] for ``stall_timeout`` seconds.
            PreemptedError: one of ``preempt_signals`` reached the parent; the ranks were told, had
                ``preempt_grace`` seconds to save and return, and the rest were stopped.
            KeyboardInterrupt: the parent was interrupted (Ctrl-C, SIGINT); the workers were stopped first.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython, Jupyter and pytest leave this frame out of tracebacks
        control = LaunchControl()
        try:
            request = launch.CallRequest(self, args, kwargs)
            if not request.check(user_frame()):  # already a rank (of torchrun's, of an mplaunch launch)
                return in_process.run_in_process(self, args, kwargs, self.config)  # type: ignore[no-any-return]
            if request.streams:  # stopped at exit while it runs, as a submitted launch
                control = LaunchControl(stoppable=True)
                stream = launch.launch_stream(request, control, self._reported)
                return futures.stopped_at_exit(stream, control)  # type: ignore[return-value]
            return launch.launch(request, control)  # type: ignore[no-any-return]
        except BaseException as error:
            if not raised_by_design(error):
                raise
            # as concurrent.futures' result() does: cut our frames; the caller's line and the cause tell what happened
            raise error.with_traceback(None) from error.__cause__
        finally:
            if control.report is not None:
                self.last_report = control.report

    def debug(self, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the function here, in this process, as rank 0 of a world of 1, set up as a worker would be.

        For a debugger (breakpoints work) or a profiler: ``RANK``/``WORLD_SIZE``/... are set as in a worker (and
        put back afterwards), ``MASTER_ADDR``/``MASTER_PORT`` point at a store hosted here, the process group is
        initialised with ``backend`` when set (and destroyed after), and a parallel function called inside runs
        in-process too. Unlike a worker, it keeps this process's own state, threads and output.

        Returns:
            The function's value as it is (tensors stay put); a one-element list with ``return_all=True``.

        Raises:
            BaseException: whatever the function raises, unchanged.
            TypeError: the arguments do not fit the function's signature.
        """
        return in_process.run_here(self, args, kwargs, self.config)  # type: ignore[no-any-return]

    def submit(self, /, *args: P.args, **kwargs: P.kwargs) -> futures.LaunchFuture[T]:
        """Start the launch in the background and return at once a ``concurrent.futures.Future``.

        ``result()`` returns or raises exactly what calling the function with these arguments would (``exception()``
        returns that exception): the checks that depend on the call (wrong arguments, a missing main guard) run here, in
        the calling thread, and a refusal comes back in the future, as in ``ProcessPoolExecutor.submit``. The parent's
        global state (RNG states...) is captured here, so what runs after ``submit()`` does not change it for the
        workers. Several launches may run at once; ``asyncio.wrap_future(fn.submit(...))`` makes one awaitable.

        Stopping: ``future.cancel()`` stops a running launch's workers (SIGTERM, then SIGKILL after
        ``grace_period``), waits until none is left, and returns ``True`` (``result()`` then raises
        ``CancelledError``). Ctrl-C while waiting in ``result()`` or ``exception()``, interrupting an
        IPython/Jupyter cell, and the interpreter's exit stop running launches too.

        Preempting: ``future.preempt()`` tells the ranks as one of ``preempt_signals`` would (signal handlers run only
        in the main thread, so a submitted launch handles none itself); see
        [`preempt()`][mplaunch.LaunchFuture.preempt].

        Returns:
            A [`LaunchFuture`][mplaunch.LaunchFuture] (a ``concurrent.futures.Future``) of rank 0's return value (with
            ``return_all=True``, of the list of every rank's value); for a generator function, of its return value,
            with an ``items`` attribute that iterates over the values yielded, as they arrive.

        Raises:
            RuntimeError: the interpreter is shutting down, so no thread can start.

        Example:
            ```python title="Fragment: train() is a decorated function"
            future = train.submit(0.1)  # returns at once
            future.done(), future.cancel()  # (False, True): cancel() stops it
            ```
        """
        control = LaunchControl(stoppable=True)
        request = launch.CallRequest(self, args, kwargs, submitted=True)
        try:
            control.in_process = not request.check(user_frame())
        except Exception as error:  # noqa: BLE001 - a refusal is the future's outcome, as calling would raise it
            control.close()
            return futures.failed(error)
        name = getattr(self, "__qualname__", "launch")
        in_thread = futures.submit_stream if request.streams else futures.submit
        if control.in_process:  # already a rank: the function runs here, in the future's thread
            here = functools.partial(in_process.run_in_process, self, args, kwargs, self.config)
            return in_thread(lambda _: here(), control, name)
        control.queued = self.config.devices is not None  # until the launch holds its devices
        with contextlib.suppress(Exception):  # a failure: captured again in the launch, whose error the future gets
            control.state = for_launch(GlobalState.capture())
        start: Callable[[launch.CallRequest, LaunchControl], Any] = (
            launch.launch_stream if request.streams else launch.launch
        )
        return in_thread(lambda control: start(request, control), control, name)

    def _reported(self, report: RunReport) -> None:
        """Keep the report of a stream that ended (see :attr:`last_report`)."""
        self.last_report = report

    def options(self, **overrides: Unpack[LaunchOptions]) -> ParallelFunction[P, T]:
        """Return this function with some options replaced; this one is left unchanged (as Ray's
        ``.options()`` and tenacity's ``retry_with``).

        Takes the keyword options of [`parallel()`][mplaunch.parallel] (except ``return_all``, which would change the
        return type: decorate again for that); options not given keep their values. E.g.
        ``train.options(nprocs=1, timeout=60)(0.1)`` or ``train.options(max_restarts=3).submit(0.1)``.

        Returns:
            A new [`ParallelFunction`][mplaunch.ParallelFunction] of the same function with the merged options.

        Raises:
            InvalidOptionError: an option is invalid; the same checks and messages as [`parallel()`][mplaunch.parallel].
            TypeError: an unknown option name.
        """
        return ParallelFunction(self.__wrapped__, replace_options(self.config, overrides))

    def __reduce__(self) -> str | tuple[Any, ...]:
        """Pickle by name; by value where the name does not find it, or for ``__main__`` to a pickler that sends
        ``__main__`` by value (cloudpickle's, as submitit, loky, Ray and dask use: a fresh interpreter)."""
        module = getattr(self, "__module__", "")
        by_value = module == "__main__" and _main_by_value(sys._getframe(1))
        if resolve(module, getattr(self, "__qualname__", "")) is self and not by_value:
            return str(self.__qualname__)
        original = named_original(self)  # a copy with other options: its function found through the original
        if original is not None and module != "__main__":  # (a worker's __main__ may not define it)
            return (_with_options, (original, self.config))
        return (ParallelFunction, (self.__wrapped__, self.config))

    def __repr__(self) -> str:
        name = getattr(self, "__qualname__", None) or repr(self.__wrapped__)
        return f"<parallel function {getattr(self, '__module__', '?')}.{name} ({self.config})>"


class BoundParallelMethod:
    """A decorated method bound to an instance (``trainer.fit``), passed first; other attributes are the function's."""

    def __init__(self, function: ParallelFunction[..., Any], instance: object) -> None:
        self.__func__ = function
        self.__self__ = instance

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Call the decorated function with the instance first (see :meth:`ParallelFunction.__call__`)."""
        __tracebackhide__ = True  # noqa: F841 - IPython, Jupyter and pytest leave this frame out of tracebacks
        return self.__func__(self.__self__, *args, **kwargs)

    def submit(self, /, *args: Any, **kwargs: Any) -> futures.LaunchFuture[Any]:
        """Launch in the background with the instance first (see :meth:`ParallelFunction.submit`)."""
        return self.__func__.submit(self.__self__, *args, **kwargs)

    def debug(self, /, *args: Any, **kwargs: Any) -> Any:
        """Run here with the instance first (see :meth:`ParallelFunction.debug`)."""
        return self.__func__.debug(self.__self__, *args, **kwargs)

    def options(self, **overrides: Unpack[LaunchOptions]) -> BoundParallelMethod:
        """The method with some options replaced, still bound (see :meth:`ParallelFunction.options`)."""
        return BoundParallelMethod(self.__func__.options(**overrides), self.__self__)

    def __getattr__(self, name: str) -> Any:
        if name in ("__func__", "__self__"):  # not set yet (a copy being made): no recursion through them
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BoundParallelMethod)
            and other.__func__ is self.__func__
            and other.__self__ is self.__self__
        )

    def __hash__(self) -> int:
        return hash((id(self.__func__), id(self.__self__)))

    def __reduce__(self) -> tuple[Any, ...]:
        """As a bound method pickles: the instance, and the method looked up on it by name."""
        return (getattr, (self.__self__, self.__func__.__name__))

    def __repr__(self) -> str:
        return f"<bound parallel method {self.__func__.__qualname__} of {self.__self__!r}>"


def _with_options(original: ParallelFunction[P, T], config: ParallelConfig) -> ParallelFunction[P, T]:
    """Unpickle a copy made by ``options()``: the original's function (found by name) with ``config``."""
    return ParallelFunction(original.__wrapped__, config)


@overload
def parallel(function: Callable[P, R], /) -> ParallelFunction[P, R]: ...


@overload
def parallel(
    function: None = None, /, *, return_all: Literal[False] = ..., **options: Unpack[LaunchOptions]
) -> Callable[[Callable[P, R]], ParallelFunction[P, R]]: ...


@overload
def parallel(
    function: None = None, /, *, return_all: Literal[True], **options: Unpack[LaunchOptions]
) -> Callable[[Callable[P, R]], ParallelFunction[P, list[R]]]: ...


def parallel(
    function: Callable[..., Any] | None = None, /, *, return_all: bool = False, **options: Unpack[LaunchOptions]
) -> Any:
    """Make ``function`` run on ``nprocs`` worker processes of this machine each time it is called.

    Usable bare (``@parallel``) or with options (``@parallel(nprocs=2)``), checked here, when decorating. Calling the
    result starts the workers (from the calling process, the parent), runs the function once in each with the call's
    arguments, waits for all of them, and returns rank 0's value with every tensor on the CPU. Each worker sees
    torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``/``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; read it with
    [`mplaunch.worker_info()`][mplaunch.worker_info]), so ``torch.distributed.init_process_group("gloo")`` works inside
    unchanged. The parent's ``os.environ``, signal handlers and thread settings are as before when the call returns.

    Args:
        function: the function to decorate; given only in the bare form.
        return_all: return a list of every rank's value, ordered by rank, instead of rank 0's value (a parameter
            of its own: it changes the return type).
        **options: the other launch options, by keyword: the fields of [`ParallelConfig`][mplaunch.ParallelConfig]
            (``nprocs``, ``start_method``, ``timeout``...), which give each one's meaning, unit and default; the
            options reference's table says in which ways of calling each one works.

    Returns:
        A [`ParallelFunction`][mplaunch.ParallelFunction] with the signature of ``function`` (bare form), or a decorator
        that makes one.

    Raises:
        InvalidOptionError: an option is invalid; the message names it, its value and the allowed values.
        TypeError: an option name that does not exist (the message lists the options).

    Example:
        ```python title="scaled.py"
        import torch
        from mplaunch import parallel, worker_info

        @parallel(nprocs=2)
        def scaled(x: torch.Tensor) -> torch.Tensor:
            return x * (worker_info().rank + 1)  # runs in each of the 2 workers

        if __name__ == "__main__":
            print(scaled(torch.ones(3)))  # rank 0's value: tensor([1., 1., 1.])
        ```

    Note:
        Under ``spawn`` and ``forkserver`` the function and its arguments are pickled (by reference when a worker can
        import them, else by value with cloudpickle: notebooks, ``python -c``, closures), and a script must call the
        function under ``if __name__ == "__main__":``. Queues, locks, events, shared values, ``Pipe`` ends and
        ``Manager`` proxies in the arguments travel with each worker's start, as ``torch.multiprocessing.spawn`` sends
        its ``args``. Under ``fork`` nothing is pickled, but CUDA must not be initialised in the parent.

    The decorator form follows tenacity's ``retry`` and attrs' ``define``; the launcher follows
    ``torch.multiprocessing.start_processes`` and torchrun's environment contract.
    """
    config = make_config(return_all=return_all, **options)  # the options and their defaults are ParallelConfig's
    if function is not None:
        return _wrap(function, config)
    return functools.partial(_wrap, config=config)


def _main_by_value(frame: types.FrameType | None) -> bool:
    """Return whether the pickler calling ``__reduce__`` is cloudpickle's or dill's (not mplaunch's own)."""
    for _ in range(8):
        if frame is None:
            return False
        pickler = frame.f_locals.get("self")
        if pickler is not None and callable(getattr(pickler, "dump", None)) and hasattr(pickler, "memo"):
            modules = [getattr(kind, "__module__", "") or "" for kind in type(pickler).__mro__]
            if any(name.partition(".")[0] == "mplaunch" for name in modules):
                return False
            return any("cloudpickle" in name or name.partition(".")[0] == "dill" for name in modules)
        frame = frame.f_back
    return False


def _wrap(function: Any, config: ParallelConfig) -> ParallelFunction[Any, Any]:
    """Check what is being decorated, then decorate it."""
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise InvalidOptionError(
            f"parallel() cannot run the async function {function.__qualname__}: decorate a plain function that "
            "calls asyncio.run(...) instead."
        )
    if not callable(function):
        raise InvalidOptionError(
            f"parallel({function!r}) is not valid: decorate a function (@parallel), or pass options by "
            f"keyword, e.g. @parallel(nprocs={function!r})."
        )
    return ParallelFunction(function, config)
