"""The values a generator function yields in the ranks, delivered to the caller as they are produced.
A :class:`Stream` wraps one call's loop (:meth:`mplaunch._parent.ranks.Ranks.call`): each rank writes a value to
the launch directory as it is yielded and says so on its pipe; the parent reads it when the caller asks."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, ClassVar, Generic, TypeVar

from mplaunch._errors import raised_by_design
from mplaunch._platform import forks

T = TypeVar("T")
_END = object()


class Stream(Generic[T]):
    """An iterator (and async iterator) over the values that rank 0 yields, as they are yielded; with
    ``return_all=True``, over ``(rank, value)`` pairs from every rank.

    A failure in a rank is raised by the iteration after the values that came before it, as the worker's exception
    itself (as a call raises it). Breaking out of the loop and garbage collection leave the ranks' generators
    unfinished: [`close()`][mplaunch.Stream.close] (also at the end of a ``with`` block) interrupts them. ``async for``
    reads the values in a thread, so the event loop keeps running.

    Attributes:
        value: the generator's return value (rank 0's, or every rank's with ``return_all=True``), set once
            the iteration has ended; ``None`` before.
    """

    _at_exit: ClassVar[bool] = False  # the process exits: a thread still reading is a daemon one, to end quietly

    def __init__(
        self, exchange: Generator[tuple[int, Any], None, Any], release: Callable[[], None], return_all: bool
    ) -> None:
        self._exchange, self._release, self._return_all = exchange, release, return_all
        self._done = False
        self._pid = os.getpid()  # a process forked from this one has a copy, which must not touch the call
        self._reading = threading.Lock()  # held while a thread reads a value (ended_at_exit)
        self.value: Any = None

    def prime(self) -> None:
        """Run the call until its ranks run it (whether or not the values are read); raise what refuses it."""
        try:
            next(self._exchange)
        except BaseException:
            self._end()
            raise

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        """The next value (or ``(rank, value)`` pair).

        Raises:
            StopIteration: the generators have returned.
            BaseException: a rank's failure, as a call raises it.
            RuntimeError: this process was forked from the one that started the call.
        """
        __tracebackhide__ = True  # noqa: F841
        if self._done:
            raise StopIteration
        forks.check_owner(self._pid, "this mplaunch stream's values", "Read them in that process.")
        try:
            with self._reading:
                rank, value = next(self._exchange)
        except StopIteration as stop:
            self._end()
            self.value = stop.value
            raise StopIteration(self.value) from None
        except BaseException as error:
            self._end()
            if Stream._at_exit:  # the reader is a daemon thread (the others were joined): it ends quietly
                raise SystemExit from None
            if not raised_by_design(error):
                raise
            raise error.with_traceback(None) from error.__cause__
        return (rank, value) if self._return_all else value  # type: ignore[return-value]

    def close(self) -> None:
        """Interrupt the ranks' generators if they still run (``KeyboardInterrupt`` at their ``yield``) and
        end the call; does nothing once the iteration has ended, and in a process forked from the one that
        started the call, whose copy leaves the call alone."""
        if self._done:
            return
        if os.getpid() != self._pid:
            self._done = True  # (the exchange, when collected here, acts on nothing)
            return
        try:
            self._exchange.close()
        finally:
            self._end()

    def ended_at_exit(self) -> None:
        """End the call, asked to stop at exit: here while no thread reads a value, else by the reader it wakes."""
        Stream._at_exit = True
        while not self._done:
            if self._reading.acquire(timeout=0.05):  # kept: no value is read after this
                self.close()

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._release()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close()

    def __aiter__(self) -> Stream[T]:
        return self

    async def __anext__(self) -> T:
        """The next value, read in a thread.

        Raises:
            StopAsyncIteration: the generators have returned.
        """
        value = await asyncio.to_thread(next, self, _END)
        if value is _END:
            raise StopAsyncIteration
        return value  # type: ignore[return-value]

    async def aclose(self) -> None:
        """:meth:`close`, in a thread."""
        await asyncio.to_thread(self.close)


class Queued(Generic[T]):
    """The values of a stream read in another thread (a ``submit()``), as they arrive; its failure is the future's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ended = False
        self.cancel: Callable[[], object] = lambda: None  # the launch's: Ctrl-C while waiting for a value stops it

    def feed(self, stream: Iterator[T]) -> Any:
        """Put every value of ``stream`` (in the thread that reads it); return its return value."""
        while True:
            try:
                self._queue.put(next(stream))
            except StopIteration as stop:
                return stop.value

    def end(self) -> None:
        """Mark the end (after the last value, or a failure)."""
        self._queue.put(_END)

    def __iter__(self) -> Queued[T]:
        return self

    def __next__(self) -> T:
        if self._ended:
            raise StopIteration
        try:
            value = self._queue.get()
        except KeyboardInterrupt:
            self.cancel()
            raise
        if value is _END:
            self._ended = True
            raise StopIteration
        return value  # type: ignore[no-any-return]
