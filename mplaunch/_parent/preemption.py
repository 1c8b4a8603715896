"""Preemption of a one-node launch: a signal in ``preempt_signals`` (or ``future.preempt()``) raises the flag of
:mod:`mplaunch._wire.flags`; the ranks get ``preempt_grace`` seconds to save and return, then the rest are stopped
and the call raises :class:`~mplaunch.PreemptedError`. The idea follows SLURM's ``--signal``, submitit's
checkpointing and torchrun's ``--signals-to-handle``: the scheduler warns, the job saves, the scheduler requeues."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any

from mplaunch._errors import InvalidOptionError, PreemptedError, signal_name
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.outcomes import RankState, Stopped
from mplaunch._wire import flags
from mplaunch._wire.records import Returned


class Preemption:
    """A launch's preemption notice: a first :meth:`notify` starts the ``grace`` (seconds), a second ends it."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.signum: int | None = None
        self.noticed_at: float | None = None
        self.forced = False
        self.reported = False  # a PreemptedError was raised for the notice
        self.origin: int | None = None  # the node whose launching process got the notice (multi-node), if another
        self._own = False  # this process got a notice itself (a signal, future.preempt()), not only another node's
        self._mapping: mmap.mmap | None = None
        self._read, self._write = os.pipe()
        fcntl.fcntl(self._write, fcntl.F_SETFL, os.O_NONBLOCK)

    @property
    def noticed(self) -> bool:
        return self.noticed_at is not None

    def attach(self, directory: str) -> None:
        """Create the launch's flag in ``directory`` (raised at once if the notice came first)."""
        self._mapping = mapping = flags.create(directory)
        if self.noticed:
            flags.raise_flag(mapping)

    @property
    def attached(self) -> bool:
        """Whether the launch has a flag: its ranks can be told."""
        return self._mapping is not None

    def notify(self, signum: int | None, origin: int | None = None) -> None:
        """Take a notice (``signum``: ``None`` from ``future.preempt()``); a second own one forces the end. ``origin``:
        the node that got a notice passed on (a node may hear of another's signal before its own, its first)."""
        if self.noticed:
            if origin is None:
                self.forced = self._own
                self._own = True
        else:
            self._own = origin is None
            self.signum = signum
            self.origin = origin
            self.noticed_at = time.monotonic()
            mapping = self._mapping
            if mapping is not None:
                flags.raise_flag(mapping)
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is already pending
            os.write(self._write, b"x")

    def fileno(self) -> int:
        """Return a descriptor that becomes readable at each notice."""
        return self._read

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.set_blocking(self._read, False)
            os.read(self._read, 4096)

    def remaining(self) -> float | None:
        """Return the seconds left of the grace (``0.0`` when over or forced), or ``None`` before a notice."""
        if self.noticed_at is None:
            return None
        if self.forced:
            return 0.0
        return max(0.0, self.noticed_at + self.grace - time.monotonic())

    def error(self, states: Mapping[int, RankState], nprocs: int, ranks: range | None = None) -> PreemptedError:
        """Return the :class:`PreemptedError` for these rank states; ``ranks``: this node's (``range(nprocs)``)."""
        self.reported = True
        values = {rank: state.value for rank, state in sorted(states.items()) if isinstance(state, Returned)}
        ranks = range(nprocs) if ranks is None else ranks
        stopped = tuple(rank for rank in ranks if isinstance(states.get(rank), Stopped) or rank not in states)
        failures = tuple(state for _, state in sorted(states.items()) if isinstance(state, BaseException))
        what = "future.preempt()" if self.signum is None else signal_name(-self.signum)
        if self.origin is not None:
            what = f"{what}, received by node {self.origin}"
        how = "a second notice ended the grace at once" if self.forced else f"preempt_grace={self.grace:g} s"
        message = (
            f"the launch was preempted by {what} ({how}): ranks {sorted(values)} returned, ranks {list(stopped)} "
            "were stopped. Save in the ranks when mplaunch.preempted() is true, and resume on the next call."
        )
        return PreemptedError(message, self.signum, values, stopped, failures)

    def close(self) -> None:
        """Unmap the flag (before the launch directory goes) and close the pipe."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def preempt_signals(preemption: Preemption, signals: tuple[int, ...]) -> Iterator[None]:
    """Let ``signals`` notify ``preemption`` while the launch runs; after, pass on one noticed too late for any rank."""
    if not signals:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise InvalidOptionError(
            f"preempt_signals={signals!r} cannot be handled by this call: it runs in a thread other than the main "
            "thread, and Python runs signal handlers in the main thread only. Leave preempt_signals out, and "
            "preempt the call from your own handler: submit it and call future.preempt()."
        )
    owner = os.getpid()
    previous: dict[int, Any] = {}
    ended: list[bool] = []  # the launch is over: a handler left behind passes its signal on

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner or ended:  # a forked worker before its own set-up, or a handler left behind
            old = previous.get(signum) if os.getpid() == owner else None
            signal.signal(signum, signal.SIG_DFL if old is None else old)
            signal.raise_signal(signum)  # (to the handler put back)
            return
        preemption.notify(signum)

    try:
        for signum in signals:
            previous[signum] = signal.signal(signum, handler)
        yield
    except BaseException:
        preemption.reported = True  # the call ends with an error, which the caller sees: nothing to pass on
        raise
    finally:
        ended.append(True)
        # a stream may end in another thread (async for): there each handler puts the old one back itself,
        # on the next signal, from the main thread, where handlers run
        if threading.current_thread() is threading.main_thread():
            for signum, old in previous.items():
                signal.signal(signum, signal.SIG_DFL if old is None else old)
            if (
                preemption.noticed
                and not preemption.reported
                and preemption.origin is None
                and preemption.signum in previous
            ):
                signal.raise_signal(preemption.signum)


@contextlib.contextmanager
def preemption_notice(
    control: LaunchControl, directory: str, signals: tuple[int, ...], grace: float
) -> Iterator[Preemption]:
    """Yield a one-node launch's notice, its flag in ``directory`` when it can be preempted, and ``signals`` handled."""
    preemption = Preemption(grace)
    try:
        if signals or control.fileno() is not None:
            preemption.attach(directory)
        control.set_preemption(preemption)
        with preempt_signals(preemption, signals):
            yield preemption
    finally:
        control.set_preemption(None)
        preemption.close()
