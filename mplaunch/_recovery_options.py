"""Check the preemption and restart options (``preempt_signals``, ``restart_on``) of ParallelConfig."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable

from mplaunch._errors import InvalidOptionError

#: What ``restart_on`` accepts: ``None`` (every failure), exception classes, or a predicate over the failure.
RestartOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool] | None


#: Signals that a process gets for other reasons than a scheduler's notice: as preemption signals, every
#: launch would be preempted, or the parent could not go on.
_NO_NOTICE = {
    signal.SIGCHLD: "comes to the launching process whenever a worker ends",
    signal.SIGPIPE: "comes when a write finds a pipe closed (Python ignores it)",
    signal.SIGSEGV: "reports a crash of the process itself",
    signal.SIGBUS: "reports a crash of the process itself",
    signal.SIGFPE: "reports a crash of the process itself",
    signal.SIGILL: "reports a crash of the process itself",
}


def check_signals(signals: object) -> tuple[signal.Signals, ...]:
    """Return ``preempt_signals`` as a tuple of :class:`signal.Signals` (a single signal is accepted too)."""
    message = (
        f"preempt_signals={signals!r} is not valid: pass a tuple of signals that can be caught, e.g. "
        "preempt_signals=(signal.SIGTERM,) or (signal.SIGUSR1,), or () for none."
    )
    if isinstance(signals, int) and not isinstance(signals, bool):
        signals = (signals,)
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        raise InvalidOptionError(message)
    found: list[signal.Signals] = []
    for item in signals:
        if isinstance(item, bool) or not isinstance(item, int):
            raise InvalidOptionError(message)
        try:
            signum = signal.Signals(item)
        except ValueError:
            raise InvalidOptionError(f"{message} {item!r} is no signal of this platform.") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidOptionError(f"{message} {signum.name} cannot be caught, so no process can be told of it.")
        if signum in _NO_NOTICE:
            raise InvalidOptionError(f"{message} {signum.name} {_NO_NOTICE[signum]}, not a notice to stop.")
        if signum not in found:
            found.append(signum)
    return tuple(found)


def check_restart_on(restart_on: object) -> RestartOn:
    """Return ``restart_on`` as ``None``, a tuple of exception classes, or a predicate."""
    if restart_on is None:
        return None
    allowed = (
        "pass exception classes, e.g. restart_on=(ConnectionError, TimeoutError), a function "
        "(failure) -> bool, or None to restart after every failure."
    )
    if isinstance(restart_on, type):
        restart_on = (restart_on,)
    if isinstance(restart_on, tuple):
        for item in restart_on:
            if not isinstance(item, type) or not issubclass(item, BaseException):
                raise InvalidOptionError(
                    f"restart_on={restart_on!r} is not valid: {item!r} is not an exception class; {allowed}"
                )
        return restart_on
    if callable(restart_on):
        return restart_on
    raise InvalidOptionError(f"restart_on={restart_on!r} is not valid: {allowed}")
