"""The records that cross between the parent and its workers, and their names: a :class:`Payload` (or a :class:`Call`
per warm call) out, one outcome per worker (:class:`Returned`, :class:`Raised`, :class:`Signalled`) back. The design
follows CPython's ``concurrent.futures.process`` (``_CallItem``, ``_ResultItem``)."""

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
    """The parent's global state as captured for the workers (:mod:`mplaunch._state.snapshot`)."""

    def restore(self) -> None:
        """Restore it in this worker."""


PAYLOAD = "payload"
REMOTE_RANK0 = "remote-rank0"
NODE_ROUND = "node-round"  # a multi-node round's variables for this node's ranks, written as it begins
_RANK_PREFIX = "rank"


def outcome_name(rank: int) -> str:
    """Name the outcome of rank ``rank`` in the launch directory."""
    return f"{_RANK_PREFIX}{rank}"


def outcome_rank(filename: str) -> int | None:
    """Return the rank whose complete outcome ``filename`` is, else ``None``."""
    stem, dot, extension = filename.partition(".")
    number = stem[len(_RANK_PREFIX) :]
    if stem.startswith(_RANK_PREFIX) and number.isascii() and number.isdigit() and dot and extension == "pkl":
        return int(number)
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Payload:
    """The function, its arguments and the parent's state; inherited under fork, else read from a file."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: State


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One call to warm workers, written once as :func:`call_name` and read by every rank."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    filename: str | None = None  # for tracebacks: cloudpickle's code says <dynamic-code>


def call_name(number: int) -> str:
    """Name warm call ``number`` in the launch directory."""
    return f"call{number}"


def result_name(number: int, rank: int) -> str:
    """Name rank ``rank``'s outcome of warm call ``number``."""
    return f"result{number}-{rank}"


def item_name(number: int, rank: int, index: int) -> str:
    """Name the ``index``-th value rank ``rank`` yielded in warm call ``number``."""
    return f"item{number}-{rank}-{index}"


# Control messages on a warm rank's pipe (objects travel as files). Parent to rank: (CALL, number,
# takes_ctrl_c, report_all): run it (a SIGINT to the caller's group interrupts it only if takes_ctrl_c, made
# from the caller's main thread); (CANCEL, number): unwanted, sent before the SIGINT; (EXIT,): leave.
# Rank to parent: (READY,) once set up; (ITEM, number, index): a value was yielded; (DONE, number).
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
    """The function raised; ``exception`` is it pickled, or ``None`` when it cannot be."""

    pid: int
    exception: bytes | None
    type_name: str
    message: str
    text: str  # the formatted traceback
    exit_code: int | None = None  # CPython's for SystemExit and KeyboardInterrupt, else None
    when: float = 0.0  # time.monotonic(): the launch's first failure is known whatever order ranks end in

    @classmethod
    def of(cls, error: BaseException, when: float | None = None) -> Raised:
        """Record ``error``, raised here at ``when`` (``time.monotonic()``; default now); never raises."""
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
    """A stop signal ``signum`` the worker caught ended it before it returned."""

    pid: int
    signum: int


Outcome = Returned | Raised | Signalled


def exit_status(code: object) -> int:
    """Return the exit status CPython gives ``sys.exit(code)``."""
    return 0 if code is None else int(code) if isinstance(code, int) else 1


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
