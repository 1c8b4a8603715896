"""``parallel()`` and the function object it returns."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar, overload

from typing_extensions import ParamSpec

from mplaunch import _launcher
from mplaunch._config import LaunchConfig, make_config
from mplaunch._errors import InvalidOptionError

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class ParallelFunction(Generic[P, T]):
    """A function that, when called, runs on ``nprocs`` worker processes and returns rank 0's value.

    Made by :func:`parallel`; it has the wrapped function's signature, ``__name__``, ``__qualname__``,
    ``__module__`` and ``__doc__``. ``__wrapped__`` is the plain function; :meth:`debug` runs it here as
    rank 0 of a world of 1 with a worker's setup (environment, process group), for debuggers. It pickles by
    reference (module and qualified name), so workers started with ``spawn`` or ``forkserver`` find it by
    importing its module, without launching again.

    Attributes:
        config: the validated launch options (:class:`~mplaunch.LaunchConfig`).
    """

    __wrapped__: Callable[P, Any]
    __name__: str
    __qualname__: str

    def __init__(self, function: Callable[P, Any], config: LaunchConfig) -> None:
        functools.update_wrapper(self, function)
        self.config = config

    @property
    def _mplaunch_target(self) -> Callable[P, Any]:
        return self.__wrapped__

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        """Bind a decorated method to ``instance``, which becomes the first argument (pickled under spawn)."""
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Start the workers, run the function in each with these arguments, wait, and return the result.

        Returns:
            Rank 0's return value with every tensor on the CPU, or, with ``return_all=True``, a list of every
            rank's value ordered by rank.

        Raises:
            BaseException: the exception a worker raised, as its own type, with ``rank`` and ``pid``
                attributes and the worker's traceback as ``__cause__``; ``failures`` holds other ranks' failures.
            LaunchRefusedError: a check before launching failed (main guard, CUDA before fork, an argument
                that cannot be pickled under spawn/forkserver); no worker was started.
            WorkerExitedError: a worker was killed, exited non-zero, or exited without returning.
            RemoteError: a worker's exception or result could not be pickled or unpickled.
            LaunchTimeoutError: the launch ran past ``timeout`` seconds.
            KeyboardInterrupt: the parent was interrupted (Ctrl-C, SIGINT); the workers were stopped first.
        """
        return _launcher.launch(self, args, kwargs, self.config, sys._getframe(1))  # type: ignore[no-any-return]

    def debug(self, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the function here, in this process, as rank 0 of a world of 1, set up as a worker would be.

        For a debugger (breakpoints work) or a profiler: ``RANK``/``WORLD_SIZE``/... are set as in a worker
        (and put back afterwards), ``MASTER_ADDR``/``MASTER_PORT`` point at a store hosted here, the process
        group is initialised with ``backend`` when set (and destroyed after), and a parallel function called
        inside runs in-process too. Unlike a worker, it keeps this process's own state, threads and output.

        Returns:
            The function's value as it is (tensors stay where they are); a one-element list with
            ``return_all=True``.

        Raises:
            BaseException: whatever the function raises, unchanged.
            TypeError: the arguments do not fit the function's signature.
        """
        return _launcher.run_here(self, args, kwargs, self.config)  # type: ignore[no-any-return]

    def __reduce__(self) -> str | tuple[Any, ...]:
        module = sys.modules.get(getattr(self, "__module__", ""))
        holder: Any = module
        for part in getattr(self, "__qualname__", "<unnamed>").split("."):
            holder = getattr(holder, part, None)
        if holder is self:
            return str(self.__qualname__)
        return (ParallelFunction, (self.__wrapped__, self.config))

    def __repr__(self) -> str:
        name = getattr(self, "__qualname__", None) or repr(self.__wrapped__)
        return f"<parallel function {getattr(self, '__module__', '?')}.{name} ({self.config})>"


@overload
def parallel(function: Callable[P, R], /) -> ParallelFunction[P, R]: ...


@overload
def parallel(
    function: None = None,
    /,
    *,
    nprocs: int | Literal["auto"] = ...,
    start_method: str | None = ...,
    return_all: Literal[False] = ...,
    timeout: float | None = ...,
    grace_period: float = ...,
    backend: str | None = ...,
    prefix_output: bool = ...,
    console_ranks: Iterable[int] | None = ...,
    log_dir: str | os.PathLike[str] | None = ...,
    nnodes: int | None = ...,
    node_rank: int | None = ...,
    rdzv_endpoint: str | None = ...,
    max_restarts: int = ...,
    rdzv_timeout: float = ...,
) -> Callable[[Callable[P, R]], ParallelFunction[P, R]]: ...


@overload
def parallel(
    function: None = None,
    /,
    *,
    nprocs: int | Literal["auto"] = ...,
    start_method: str | None = ...,
    return_all: Literal[True],
    timeout: float | None = ...,
    grace_period: float = ...,
    backend: str | None = ...,
    prefix_output: bool = ...,
    console_ranks: Iterable[int] | None = ...,
    log_dir: str | os.PathLike[str] | None = ...,
    nnodes: int | None = ...,
    node_rank: int | None = ...,
    rdzv_endpoint: str | None = ...,
    max_restarts: int = ...,
    rdzv_timeout: float = ...,
) -> Callable[[Callable[P, R]], ParallelFunction[P, list[R]]]: ...


def parallel(
    function: Callable[..., Any] | None = None,
    /,
    *,
    nprocs: int | Literal["auto"] = "auto",
    start_method: str | None = None,
    return_all: bool = False,
    timeout: float | None = None,
    grace_period: float = 5.0,
    backend: str | None = None,
    prefix_output: bool = False,
    console_ranks: Iterable[int] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout: float = 600.0,
) -> Any:
    """Make ``function`` run on ``nprocs`` worker processes of this machine each time it is called.

    Usable bare (``@parallel``) or with options (``@parallel(nprocs=2)``). Options are checked here, when
    decorating. Calling the result starts the workers (in the calling process, the parent), runs the
    function once per worker with the call's arguments, waits for all of them, and returns rank 0's value
    with every tensor on the CPU. Each worker sees torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so
    ``torch.distributed.init_process_group("gloo")`` works inside unchanged; read it with
    :func:`mplaunch.worker_info`. The parent's ``os.environ``, signal handlers and thread settings are as
    before when the call returns.

    Args:
        function: the function to decorate; given only in the bare form.
        nprocs: worker processes per call, an int >= 1, or ``"auto"`` (the default): the number of visible
            CUDA devices when CUDA is available, else the number of usable CPU cores.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (``multiprocessing``'s names), or ``None``
            (default): ``fork`` in an interactive session (REPL, IPython, Jupyter) where fork exists and CUDA
            is not initialised, ``spawn`` otherwise.
        return_all: return a list of every rank's value, ordered by rank, instead of rank 0's value.
        timeout: seconds the whole call may take before every worker is stopped, or ``None`` for no limit.
        grace_period: seconds between SIGTERM and SIGKILL when workers are stopped early.
        backend: a ``torch.distributed`` backend (``"gloo"``, ``"nccl"``, ...) or ``"auto"`` (nccl when CUDA
            is available with a device per worker, else gloo): each worker calls ``init_process_group`` with
            it before the function (binding ``cuda:LOCAL_RANK`` first for nccl) and ``destroy_process_group``
            after it, also when it raises. ``None`` (default): the function manages process groups itself.
        prefix_output: prefix every line a worker writes to its stdout or stderr (file descriptors 1 and 2:
            ``print``, logging, C code, subprocesses) with ``[rank N] ``.
        console_ranks: ranks whose output reaches the console, e.g. ``[0]``; ``None`` (default): all. The
            other ranks' output is dropped unless ``log_dir`` is set (as torchrun's ``--local-ranks-filter``).
        log_dir: directory (created if needed) where each rank's output is also written to ``rank{N}.log``,
            overwritten at each call.
        nnodes: number of nodes (machines) taking part, each running this call with ``nprocs`` workers;
            ``None`` (default) reads ``MPLAUNCH_NNODES`` (or SLURM's, in an ``srun`` step with one task per
            node), else 1. With more than one, the call launches through
            ``torch.distributed.launcher.api.elastic_launch`` with c10d rendezvous, and returns rank 0's value
            on every node (with ``return_all``, this node's ranks' values).
        node_rank: this node's index (``MPLAUNCH_NODE_RANK``, ``SLURM_NODEID``); informative, as c10d
            rendezvous orders the nodes itself.
        rdzv_endpoint: ``host[:port]`` every node can reach, where node 0's agent hosts the rendezvous
            (``MPLAUNCH_RDZV_ENDPOINT``; default port 29400).
        max_restarts: times elastic may restart all workers after a failure (multi-node only).
        rdzv_timeout: seconds to wait for all ``nnodes`` nodes to join before ``LaunchTimeoutError``.

    Returns:
        A :class:`ParallelFunction` with the signature of ``function`` (bare form), or a decorator that
        makes one.

    Raises:
        InvalidOptionError: an option is invalid; the message names it, its value and the allowed values.

    Example:
        >>> @parallel(nprocs=2, start_method="spawn")  # doctest: +SKIP
        ... def train(lr: float) -> dict:
        ...     return model.state_dict()
        >>> if __name__ == "__main__":  # doctest: +SKIP
        ...     weights = train(0.1)

    Note:
        Under ``spawn`` and ``forkserver`` the function and its arguments are pickled (by reference when a
        worker can import them, by value with cloudpickle otherwise: notebooks, ``python -c``, closures), and
        a script must call the function under ``if __name__ == "__main__":``. Under ``fork`` nothing is
        pickled, but CUDA must not be initialised in the parent.

    The decorator form follows tenacity's ``retry`` and attrs' ``define``; the launcher follows
    ``torch.multiprocessing.start_processes`` and torchrun's environment contract.
    """
    config = make_config(
        nprocs=nprocs,
        start_method=start_method,
        return_all=return_all,
        timeout=timeout,
        grace_period=grace_period,
        backend=backend,
        prefix_output=prefix_output,
        console_ranks=console_ranks,
        log_dir=log_dir,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        rdzv_timeout=rdzv_timeout,
    )
    if function is not None:
        return _wrap(function, config)

    def decorate(fn: Callable[P, R]) -> ParallelFunction[P, Any]:
        return _wrap(fn, config)

    return decorate


def _wrap(function: Any, config: LaunchConfig) -> ParallelFunction[Any, Any]:
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
