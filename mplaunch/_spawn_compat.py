"""``mplaunch.spawn``: ``torch.multiprocessing.spawn``'s signature on mplaunch's launch."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from mplaunch._api import ParallelFunction
from mplaunch._config import StartMethod, make_config
from mplaunch._errors import InvalidOptionError


class _IndexedCall:
    """Run ``function(i, *args)``, ``i`` the process index (``LOCAL_RANK``), as ``torch.multiprocessing.spawn`` does."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):  # for messages and tracebacks
            if hasattr(function, name):
                setattr(self, name, getattr(function, name))

    def __call__(self, *args: Any) -> Any:
        return self.function(int(os.environ.get("LOCAL_RANK", "0")), *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_IndexedCall, (self.function,))


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: StartMethod = "spawn",
    **options: Any,
) -> Any:
    """Run ``fn(i, *args)`` in ``nprocs`` worker processes, ``i`` the process index: the signature of
    ``torch.multiprocessing.spawn``, so porting is a one-line change (``mp.spawn(...)`` to
    ``mplaunch.spawn(...)``), on mplaunch's launch.

    Each worker is a rank as with [`mplaunch.parallel()`][mplaunch.parallel]: torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...), output, signals, stopping, errors and clean-up. A rank may
    still set ``MASTER_ADDR``/``MASTER_PORT`` itself before ``init_process_group``, as the PyTorch DDP tutorial does:
    rank 0 then hosts the store there, as under ``torch.multiprocessing.spawn``.

    Differences from ``torch.multiprocessing.spawn``:

    - it returns rank 0's value (torch returns ``None``);
    - ``join=False`` returns a ``concurrent.futures.Future`` of that value (see
      [`ParallelFunction.submit()`][mplaunch.ParallelFunction.submit]; torch returns a ``ProcessContext``);
    - a failing rank's exception is raised as itself, with the worker's traceback as its cause (torch raises
      ``ProcessRaisedException``); an exit or a signal raises [`WorkerExitedError`][mplaunch.WorkerExitedError] (torch:
      ``ProcessExitedException``);
    - ``daemon`` is accepted and has no effect: workers never outlive the calling process, whatever it is.

    Args:
        fn: the function each worker runs, called as ``fn(i, *args)``; under ``spawn`` and ``forkserver`` it
            and ``args`` are pickled, as [`mplaunch.parallel()`][mplaunch.parallel] pickles a call.
        args: the arguments after the index, a tuple or list.
        nprocs: number of worker processes, an int >= 1.
        join: wait and return rank 0's value; ``False``: return a future at once.
        daemon: accepted for ``torch.multiprocessing.spawn``'s signature; ignored.
        start_method: ``"spawn"`` (default, as torch's), ``"fork"`` or ``"forkserver"``.
        **options: other launch options of [`mplaunch.parallel()`][mplaunch.parallel] (those of
            [`LaunchOptions`][mplaunch.LaunchOptions]: ``timeout``, ``grace_period``, ``backend``, ``max_restarts``...).

    Returns:
        Rank 0's return value; with ``join=False``, a ``concurrent.futures.Future`` of it.

    Raises:
        InvalidOptionError: ``fn`` is not callable, ``args`` is not a tuple or list, or an option is invalid.
        BaseException: what calling a [`mplaunch.parallel()`][mplaunch.parallel] function raises (a rank's exception,
            [`WorkerExitedError`][mplaunch.WorkerExitedError], [`LaunchTimeoutError`][mplaunch.LaunchTimeoutError],
            [`LaunchRefusedError`][mplaunch.LaunchRefusedError]...).

    Example:
        ```python title="Fragment: main() is a torch.multiprocessing.spawn target"
        if __name__ == "__main__":
            mplaunch.spawn(main, args=(world_size,), nprocs=world_size)  # mp.spawn
        ```
    """
    if not callable(fn):
        raise InvalidOptionError(f"spawn(fn={fn!r}): fn must be a function, called as fn(i, *args).")
    if not isinstance(args, (tuple, list)):
        raise InvalidOptionError(
            f"spawn(args={args!r}): args must be a tuple or list of the arguments after the index, e.g. args=(2,)."
        )
    del daemon  # workers end with the caller in any case
    function: ParallelFunction[..., Any] = ParallelFunction(
        _IndexedCall(fn), make_config(nprocs=nprocs, start_method=start_method, **options)
    )
    if not join:
        return function.submit(*args)
    return function(*args)
