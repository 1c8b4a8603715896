"""Restarting every worker of a one-node launch after a worker failure, as torchrun's ``--max-restarts`` does.

Only a worker failure (an exception, an exit or a signal of a worker) that ``restart_on`` accepts is
restarted, after ``restart_delay`` seconds, doubled for each further restart (at most 60 s). A refusal
before launching, the launch's ``timeout`` (one deadline for all attempts, the delays included), a stop
request (``Future.cancel()``), a preemption and Ctrl-C or a signal to the parent end the launch at once.
Each attempt gets a fresh rendezvous store (as torchrun's agent does), so keys left by the failed attempt
cannot mislead the next one; the call's payload is written once and reused.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Generator
from multiprocessing.connection import wait
from typing import Any, TypeVar

from mplaunch._errors import RemoteTraceback, WorkerFailedError
from mplaunch._frames import warn_at_user
from mplaunch._parent.control import LaunchControl
from mplaunch._recovery_options import RestartOn

T = TypeVar("T")

#: The longest wait between two attempts, in seconds.
MAX_DELAY = 60.0


class RestartWarning(RuntimeWarning):
    """Issued in the parent each time a launch restarts all its workers after a worker failure
    (``max_restarts``); the message names the failure and the attempt."""


def run_attempts(
    attempt: Callable[[int], Generator[T, None, list[Any]]],
    max_restarts: int,
    control: LaunchControl,
    restart_on: RestartOn = None,
    restart_delay: float = 0.0,
) -> Generator[T, None, list[Any]]:
    """Run ``attempt(restart_count)`` (yielding what it yields: a stream's values) until it returns,
    restarting after each worker failure that ``restart_on`` accepts, at most ``max_restarts`` times, while
    time is left; wait :func:`restart_delay_of` before each restart. The exception that ends the launch gets
    an ``earlier_attempts`` attribute: the failures of the attempts before it, oldest first."""
    earlier: list[BaseException] = []
    restart = 0
    while True:
        control.check()
        try:
            return (yield from attempt(restart))
        except Exception as error:
            delay = restart_delay_of(restart + 1, restart_delay)
            remaining = control.remaining()
            if (
                error is not control.failure
                or restart >= max_restarts
                or remaining == 0.0
                or (remaining is not None and remaining < delay)  # the next attempt could not start in time
                or not restartable(error, restart_on)
            ):
                with contextlib.suppress(AttributeError, TypeError):
                    error.earlier_attempts = tuple(earlier)  # type: ignore[attr-defined]
                raise
            earlier.append(error)
            restart += 1
            show_failure(error, restart, max_restarts, delay)
            warn_at_user(describe_restart(error, restart, max_restarts), RestartWarning)
            pause(delay, control)


def restartable(failure: BaseException, restart_on: RestartOn) -> bool:
    """Whether ``restart_on`` (``None``: every failure; exception classes; a predicate) accepts ``failure``.
    The predicate runs here, in the parent; an exception it raises is raised from the launch."""
    if restart_on is None:
        return True
    if isinstance(restart_on, tuple):
        return isinstance(failure, restart_on)
    return bool(restart_on(failure))


def restart_delay_of(restart: int, restart_delay: float) -> float:
    """Seconds to wait before restart number ``restart`` (1-based): ``restart_delay`` doubled for each restart
    after the first, at most :data:`MAX_DELAY` (e.g. 0.3, 0.6, 1.2, ...)."""
    if restart_delay <= 0.0:
        return 0.0
    return min(MAX_DELAY, restart_delay * 2.0 ** min(restart - 1, 64))


def pause(seconds: float, control: LaunchControl) -> None:
    """Wait ``seconds`` before a restart; a stop request or a preemption ends the wait at once (Ctrl-C too: it
    interrupts the wait in the main thread). The caller's next ``control.check()`` or attempt acts on them."""
    if seconds <= 0.0:
        return
    preemption = control.preemption
    watched = [fd for fd in (control.fileno(), preemption.fileno() if preemption else None) if fd is not None]
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if control.stop_requested or (preemption is not None and preemption.noticed):
            return
        if watched:
            wait(watched, timeout=left)
        else:
            time.sleep(left)


def show_failure(failure: BaseException, restart: int, max_restarts: int, delay: float) -> None:
    """Write the failure that causes a restart to stderr with its rank and the worker's traceback, as torchrun's
    agent prints a failed worker's error before restarting."""
    rank = getattr(failure, "rank", "?")
    cause = failure.__cause__
    if isinstance(cause, RemoteTraceback):
        detail = cause.tb.strip('\n"')
    else:
        detail = f"{type(failure).__qualname__}: {failure}"
    when = f" in {delay:g} s" if delay else ""
    lines = [
        f"mplaunch: rank {rank} failed in attempt {restart} of {max_restarts + 1}; restarting all workers{when}.",
        *detail.splitlines(),
    ]
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write("".join(f"[rank {rank}]: {line}\n" if i else f"{line}\n" for i, line in enumerate(lines)))
        sys.stderr.flush()


def describe_restart(failure: BaseException, restart: int, max_restarts: int) -> str:
    """The warning announcing restart number ``restart`` (1-based) after ``failure``."""
    if isinstance(failure, WorkerFailedError):
        what = str(failure)
    else:
        what = f"rank {getattr(failure, 'rank', '?')} raised {type(failure).__qualname__}: {failure}"
    return (
        f"mplaunch: attempt {restart} of {max_restarts + 1} failed ({what}); all workers were stopped and start "
        f"again (restart {restart} of max_restarts={max_restarts}, TORCHELASTIC_RESTART_COUNT={restart})."
    )
