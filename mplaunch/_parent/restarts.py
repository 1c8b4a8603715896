"""Restarting every worker of a one-node launch after a worker failure, as torchrun's ``--max-restarts`` does.
Only a worker failure that ``restart_on`` accepts is restarted, after ``restart_delay`` seconds, doubled each
time (at most 60 s); anything else ends the launch at once. One deadline covers all attempts. Each attempt gets
a fresh rendezvous store (as torchrun's agent does), so keys left by a failed attempt cannot mislead the next."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Generator
from multiprocessing.connection import wait
from typing import Any, TypeVar

from mplaunch._errors import RemoteTraceback, WorkerFailedError, set_attribute
from mplaunch._frames import warn_at_user
from mplaunch._parent.control import LaunchControl
from mplaunch._recovery_options import RestartOn

T = TypeVar("T")

MAX_DELAY = 60.0  # the longest wait between two attempts, in seconds


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
    """Run ``attempt(restart_count)`` until it returns; the failure that ends it keeps the ``earlier_attempts``."""
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
                set_attribute(error, "earlier_attempts", tuple(earlier))
                raise
            earlier.append(error)
            restart += 1
            show_failure(error, restart, max_restarts, delay)
            warn_at_user(describe_restart(error, restart, max_restarts), RestartWarning)
            pause(delay, control)


def restartable(failure: BaseException, restart_on: RestartOn) -> bool:
    """Whether ``restart_on`` (``None``: all; exception classes; a predicate, run here) accepts ``failure``."""
    if restart_on is None:
        return True
    if isinstance(restart_on, tuple):
        return isinstance(failure, restart_on)
    return bool(restart_on(failure))


def restart_delay_of(restart: int, restart_delay: float) -> float:
    """Return the seconds before restart ``restart`` (1-based): ``restart_delay`` doubled each time, capped."""
    if restart_delay <= 0.0:
        return 0.0
    return min(MAX_DELAY, restart_delay * 2.0 ** min(restart - 1, 64))


def pause(seconds: float, control: LaunchControl) -> None:
    """Wait ``seconds`` before a restart; a stop request or a preemption ends the wait (the caller acts on it)."""
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
    """Write the failure that causes a restart to stderr with the worker's traceback, as torchrun's agent does."""
    rank = getattr(failure, "rank", "?")
    cause = failure.__cause__
    detail = cause.tb.strip('\n"') if isinstance(cause, RemoteTraceback) else f"{type(failure).__qualname__}: {failure}"
    when = f" in {delay:g} s" if delay else ""
    lines = [
        f"mplaunch: rank {rank} failed in attempt {restart} of {max_restarts + 1}; restarting all workers{when}.",
        *detail.splitlines(),
    ]
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write("".join(f"[rank {rank}]: {line}\n" if i else f"{line}\n" for i, line in enumerate(lines)))
        sys.stderr.flush()


def describe_restart(failure: BaseException, restart: int, max_restarts: int) -> str:
    """Return the warning announcing restart ``restart`` (1-based) after ``failure``."""
    what = str(failure)
    if not isinstance(failure, WorkerFailedError):
        what = f"rank {getattr(failure, 'rank', '?')} raised {type(failure).__qualname__}: {what}"
    return (
        f"mplaunch: attempt {restart} of {max_restarts + 1} failed ({what}); all workers were stopped and start "
        f"again (restart {restart} of max_restarts={max_restarts}, TORCHELASTIC_RESTART_COUNT={restart})."
    )
