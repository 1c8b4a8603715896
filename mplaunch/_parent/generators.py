"""``parallel()`` on a generator function: each call starts warm workers for one call, whose
:class:`~mplaunch.Stream` closes them when it ends (see :mod:`mplaunch._parent.warm`)."""

from __future__ import annotations

from typing import Any

from mplaunch._config import ParallelConfig
from mplaunch._env import outer_launcher
from mplaunch._parent import checks, futures
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.in_process import run_in_process
from mplaunch._parent.stream import Queued
from mplaunch._parent.warm import Workers


def launch_stream(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: ParallelConfig, frame: Any
) -> Any:
    """Call a decorated generator function: start its ranks, and return the :class:`Stream` of its values;
    the ranks are closed when the stream ends (exhausted, closed, failed, or garbage collected). Under an
    outer launcher, the generator runs here, as any call does.

    Raises:
        InvalidOptionError: ``max_restarts`` or ``nnodes`` > 1, which a stream cannot honour.
    """
    checks.check_not_bootstrapping(getattr(function, "__name__", "the function"))
    if outer_launcher() is not None:
        return run_in_process(function, args, kwargs, config)
    checks.check_arguments(function, args, kwargs)
    workers = Workers._of(config, frame)
    try:
        stream = workers._stream(function._mplaunch_target, args, kwargs)
    except BaseException:
        workers.close()
        raise
    stream._after.append(workers.close)
    return stream


def submit_stream(
    function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: ParallelConfig
) -> futures.LaunchFuture[Any]:
    """``submit()`` of a decorated generator function: a future of its return value, whose ``items``
    iterate over its values as they come (see :meth:`Workers.submit`)."""
    control = LaunchControl(stoppable=True)
    try:
        checks.check_arguments(function, args, kwargs)
    except Exception as error:  # noqa: BLE001 - the future's outcome, as calling would raise it
        control.close()
        return futures.failed(error)
    items: Queued[Any] = Queued()

    def run(control: LaunchControl) -> Any:
        workers = Workers._of(config, None)
        try:
            stream = workers._stream(function._mplaunch_target, args, kwargs, control)
            items.feed(stream)
            return stream.value
        finally:
            items.end()
            workers.close()

    future = futures.submit(run, control, getattr(function, "__qualname__", "launch"))
    future.items = items  # type: ignore[attr-defined]
    return future
