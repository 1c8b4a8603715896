"""The records that cross the boundary between the parent and its workers, and the names they travel under.

The parent writes one :class:`Payload` (the call) for workers that cannot inherit it, or a :class:`Call` per
call of warm workers, and starts each worker with its spec (:mod:`mplaunch._wire.spec`); every worker writes
one outcome record for its rank (for each warm call) before it exits: :class:`Returned`, :class:`Raised`, or
:class:`Signalled` (a stop signal ended it). How the parent judges them is its own
(:mod:`mplaunch._parent.outcomes`). Worker and parent code depend on this module, not on each other. The
design follows CPython's ``concurrent.futures.process`` (``_CallItem``, ``_ResultItem``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from mplaunch._frames import without_our_frames


class State(Protocol):
    """The parent's global state as captured for the workers (see :mod:`mplaunch._state.snapshot`)."""

    def restore(self) -> None:
        """Put it in place in this (worker) process."""


#: Name of the call in the launch directory.
PAYLOAD = "payload"
#: Rank 0's outcome, fetched by a node of a multi-node launch that does not run rank 0.
REMOTE_RANK0 = "remote-rank0"
_RANK_PREFIX = "rank"


def outcome_name(rank: int) -> str:
    """The name under which rank ``rank`` writes its outcome in the launch directory."""
    return f"{_RANK_PREFIX}{rank}"


def outcome_rank(filename: str) -> int | None:
    """The rank whose complete outcome ``filename`` (an entry of the launch directory) is, else ``None``."""
    stem, dot, extension = filename.partition(".")
    number = stem[len(_RANK_PREFIX) :]
    if stem.startswith(_RANK_PREFIX) and number.isascii() and number.isdigit() and dot and extension == "pkl":
        return int(number)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Payload:
    """The function, its arguments and the parent's state (what a forked worker does not inherit as it is,
    when the launch forks at once); under fork it is inherited, else read from a file."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: State


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One call to warm workers (:class:`mplaunch.Workers`), written once to the launch directory as
    :func:`call_name` and read by every rank: the plain function, its arguments, and the file it was defined
    in (tracebacks and debuggers show it, where a function sent by value would say ``<dynamic-code>``)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    filename: str | None = None  # the function's source file: cloudpickle sends code without it


def call_name(number: int) -> str:
    """The name of warm call ``number`` in the launch directory."""
    return f"call{number}"


def result_name(number: int, rank: int) -> str:
    """The name of rank ``rank``'s outcome of warm call ``number`` (read by the parent, then removed)."""
    return f"result{number}-{rank}"


def item_name(number: int, rank: int, index: int) -> str:
    """The name of the ``index``-th value that rank ``rank`` yielded in warm call ``number``."""
    return f"item{number}-{rank}-{index}"


#: Control messages on a warm rank's pipe (small tuples; the objects travel as files, see above).
#: Parent to rank: ``(CALL, number, takes_ctrl_c, report_all)`` run call ``number`` (a SIGINT to the caller's
#: group interrupts it only if ``takes_ctrl_c``: it was made from the caller's main thread; every rank sends its
#: value with ``report_all``); ``(CANCEL, number)``
#: it is no longer wanted (sent before the SIGINT that interrupts it); ``(EXIT,)`` leave (a call that runs is
#: interrupted). Rank to parent:
#: ``(READY,)`` the rank is set up (once, before its first call); ``(ITEM, number, index)`` a value was
#: yielded; ``(DONE, number)`` the outcome is written.
CALL, CANCEL, EXIT, ITEM, DONE, READY = "call", "cancel", "exit", "item", "done", "ready"


@dataclasses.dataclass(frozen=True, slots=True)
class Returned:
    """The function returned ``value`` (``None`` for ranks that do not report)."""

    pid: int
    value: Any

    def __reduce__(self) -> tuple[Any, ...]:
        # the fields as arguments: a slotted dataclass's own state functions cost a worker a dozen calls
        return (Returned, (self.pid, self.value))


@dataclasses.dataclass(frozen=True, slots=True)
class Raised:
    """The function raised. ``exception`` is the pickled exception, or ``None`` when it cannot be pickled.

    Attributes:
        exit_code: for ``SystemExit`` (and ``KeyboardInterrupt``), the process exit code CPython would use,
            else ``None``.
        when: ``time.monotonic()`` when it was raised, so that the first failure of a launch is known whatever
            order the processes end in (a rank's error often makes its peers fail in a collective).
    """

    pid: int
    exception: bytes | None
    type_name: str
    message: str
    text: str  # the formatted traceback
    exit_code: int | None = None
    when: float = 0.0  # time.monotonic() when it was raised (one clock for the processes of a machine)

    @classmethod
    def of(cls, error: BaseException, when: float | None = None) -> Raised:
        """The record of ``error``, raised in this process at ``when`` (``time.monotonic()``; default now);
        never raises itself."""
        tb = without_our_frames(error.__traceback__)
        try:
            text = "".join(traceback.format_exception(type(error), error, tb))
        except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error
            text = "".join(traceback.format_tb(error.__traceback__)) + _safely(repr, error)
        try:
            exception: bytes | None = _pickle_exception(error)
        except BaseException:  # noqa: BLE001 - an exception that cannot be pickled (even by exiting) travels as text
            exception = None
        exit_code = exit_status(error.code) if isinstance(error, SystemExit) else None
        if isinstance(error, KeyboardInterrupt):
            exit_code = 128 + signal.SIGINT
        return cls(
            pid=os.getpid(),
            exception=exception,
            type_name=f"{type(error).__module__}.{type(error).__qualname__}",
            message=_safely(str, error) if exit_code is None else _safely(repr, error),
            text=text,
            exit_code=exit_code,
            when=time.monotonic() if when is None else when,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Signalled:
    """The worker was ended by signal ``signum`` that it caught (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1,
    SIGUSR2), before it had returned."""

    pid: int
    signum: int


Outcome = Returned | Raised | Signalled


def exit_status(code: object) -> int:
    """The exit status CPython gives ``sys.exit(code)``: ``None`` -> 0, an int (or bool) -> itself, anything
    else -> 1 (the object is printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    return 1


def _safely(describe: Callable[[BaseException], str], error: BaseException) -> str:
    try:
        return describe(error)
    except Exception as failure:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"<{type(error).__qualname__}: {describe.__name__}() failed with {type(failure).__name__}>"


def _pickle_exception(error: BaseException) -> bytes:
    import cloudpickle

    traceback_, cause, context = error.__traceback__, error.__cause__, error.__context__
    try:
        error.__traceback__ = None
        try:
            return pickle.dumps(error)
        except Exception:  # noqa: BLE001
            data: bytes = cloudpickle.dumps(error)
            return data
    finally:
        error.__traceback__, error.__cause__, error.__context__ = traceback_, cause, context
