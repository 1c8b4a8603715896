"""Restarting every worker of a one-node launch after a worker failure, as torchrun's ``--max-restarts`` does.

Only a worker failure (an exception, an exit or a signal of a worker) is restarted. A refusal before
launching, the launch's ``timeout`` (one deadline for all attempts), a stop request (``Future.cancel()``) and
Ctrl-C or a signal to the parent end the launch at once. Each attempt gets a fresh rendezvous store (as
torchrun's agent does), so keys left by the failed attempt cannot mislead the next one; the call's payload
is written once and reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from mplaunch._errors import WorkerFailedError
from mplaunch._frames import warn_at_user
from mplaunch._parent.control import LaunchControl


class RestartWarning(RuntimeWarning):
    """Issued in the parent each time a launch restarts all its workers after a worker failure
    (``max_restarts``); the message names the failure and the attempt."""


def run_attempts(attempt: Callable[[int], list[Any]], max_restarts: int, control: LaunchControl) -> list[Any]:
    """Call ``attempt(restart_count)`` until it returns, restarting after each worker failure at most
    ``max_restarts`` times while time is left. The exception that ends the launch gets an ``earlier_attempts``
    attribute: the failures of the attempts before it, oldest first."""
    earlier: list[BaseException] = []
    restart = 0
    while True:
        control.check()
        try:
            return attempt(restart)
        except Exception as error:
            if error is not control.failure or restart >= max_restarts or control.remaining() == 0.0:
                with contextlib.suppress(AttributeError, TypeError):
                    error.earlier_attempts = tuple(earlier)  # type: ignore[attr-defined]
                raise
            earlier.append(error)
            restart += 1
            warn_at_user(describe_restart(error, restart, max_restarts), RestartWarning)


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
