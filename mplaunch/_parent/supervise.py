"""Watching the workers of one launch: reading their outcomes, stopping them, raising the first failure."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from mplaunch._errors import LaunchTimeoutError, RemoteError
from mplaunch._parent.control import LaunchControl, LaunchStopped
from mplaunch._parent.processes import signal_worker
from mplaunch._parent.signals import signals_held
from mplaunch._parent.store import Rendezvous
from mplaunch._wire import transport
from mplaunch._wire.records import (
    Outcome,
    Raised,
    RankState,
    Returned,
    WorkerSpec,
    outcome_name,
    rank_state,
    set_attribute,
)


class Supervisor:
    """Waits for the workers of one launch, reads their outcomes, and stops them all.

    Args:
        spec: the launch's worker spec (directory, nprocs, reporting ranks).
        processes: the started workers, indexed by rank (filled in by the launcher as they start).
        timeout: seconds the whole launch may take, or ``None``.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        control: the launch's deadline (shared by all its attempts) and stop request.
        store: the launch's rendezvous; its store is started when a worker first connects.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        processes: list[BaseProcess],
        timeout: float | None,
        grace_period: float,
        control: LaunchControl | None = None,
        store: Rendezvous | None = None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.control = control or LaunchControl()
        self.processes = processes
        self.timeout = timeout
        self.grace_period = grace_period
        self.states: dict[int, RankState] = {}
        self.stopped: set[int] = set()
        self.failed_at: dict[int, float] = {}  # when each rank failed (raised, or was seen to end)
        self._pidfds: dict[int, int] = {}  # rank -> a pidfd of its worker (see started)

    def started(self, process: BaseProcess) -> None:
        """Take the worker just started as the next rank, and open a pidfd to wait for its end on (Linux 5.3+).

        multiprocessing's sentinel is the read end of a pipe whose write end the worker holds; a process that
        another thread of the user forks meanwhile inherits that end too and would hold the launch until it
        exits, whereas a pidfd depends on nothing the worker's neighbours hold. It is opened now, before
        anything can reap the worker (multiprocessing reaps ended children when it starts the next one), so
        its pid cannot have been given to another process yet.
        """
        self.processes.append(process)
        with contextlib.suppress(AttributeError, OSError):  # no pidfds here: the sentinel it is
            self._pidfds[len(self.processes) - 1] = os.pidfd_open(process.pid)  # type: ignore[arg-type]

    def _end(self, rank: int) -> int:
        """A descriptor that becomes readable when ``rank``'s worker ends."""
        return self._pidfds.get(rank, self.processes[rank].sentinel)

    def wait(self) -> list[Any]:
        """Wait for every worker; return the reporting ranks' values in rank order (``None`` for others).

        Raises:
            BaseException: the first failure (see :func:`~mplaunch._protocol.rank_state`), after stopping the
                other workers; their own failures are on its ``failures`` attribute.
            LaunchTimeoutError: ``timeout`` passed; every worker was stopped.
            LaunchStopped: a stop was requested through the control (the caller stops the workers).
        """
        self.control.start_clock(self.timeout)  # one deadline for every attempt of the launch
        stop = self.control.fileno()
        listener = None if self.store is None else self.store.fileno()
        self._wait({self._end(rank): rank for rank in range(len(self.processes))}, stop, listener)
        return [state.value if isinstance(state := self.states[r], Returned) else None for r in range(self.spec.nprocs)]

    def _wait(self, pending: dict[int, int], stop: int | None, listener: int | None) -> None:
        """Collect each worker as its end becomes readable (``pending``: descriptor -> rank); start the store
        when ``listener`` is; raise as :meth:`wait` says."""
        while pending:
            watched = [*pending, *(fd for fd in (stop, listener) if fd is not None)]
            ready = wait(watched, timeout=self.control.remaining())
            if not ready:
                self._raise_timeout(sorted(pending.values()))
            if stop in ready:
                raise LaunchStopped()  # the caller's clean-up stops the workers
            if listener in ready and self.store is not None:
                self.store.serve()  # a worker connected: start the store it waits for
                listener = None
            for sentinel in (fd for fd in ready if fd in pending):
                rank = pending.pop(sentinel)
                state = self._collect(rank)
                if isinstance(state, BaseException):
                    self._raise_failure(state, rank)

    def _collect(self, rank: int) -> RankState:
        """Read the outcome of a finished worker and decide its state."""
        process = self.processes[rank]
        with signals_held():  # a Ctrl-C there would lose the exit code of the worker it reaps
            process.join()
        try:
            outcome = self._load(rank)
        except Exception as error:  # noqa: BLE001 - e.g. a result class that this process cannot import
            failure = RemoteError(
                f"rank {rank} (pid {process.pid}) returned a result that cannot be unpickled in the parent: "
                f"{type(error).__name__}: {error}",
                rank,
                process.pid,
                type(error).__qualname__,
            )
            failure.__cause__ = error
            self.states[rank] = failure
            return failure
        state = rank_state(rank, outcome, process.exitcode, process.pid, rank in self.stopped)
        self.states[rank] = state
        self.failed_at[rank] = outcome.when if isinstance(outcome, Raised) else time.monotonic()
        return state

    def _load(self, rank: int) -> Outcome | None:
        """The outcome of ``rank``: from its memory file (mapped, then held only by the value's mappings), or
        from the launch directory (read into this process's memory, then unlinked)."""
        if self.spec.outcome_fds is not None:
            found: Outcome | None = transport.load_fd(self.spec.outcome_fds[rank].fd, private=False, missing_ok=True)
        else:
            found = transport.load(self.spec.directory, outcome_name(rank), private=False, remove=True, missing_ok=True)
        return found

    def _raise_failure(self, failure: BaseException, rank: int) -> None:
        """Stop the others and raise the first failure in time (the root cause: a rank's error often makes its
        peers fail in a collective, and they may end first), with the others' own failures (never the stop
        itself) on its ``failures`` attribute."""
        self.stop()
        failed = {}
        for other in range(self.spec.nprocs):
            state = self.states.get(other)
            if state is None:
                state = self._collect(other)
            if isinstance(state, BaseException):
                failed[other] = state
        rank = min(failed, key=lambda r: (self.failed_at.get(r, float("inf")), r))
        failure = failed.pop(rank)
        set_attribute(failure, "failures", tuple(failed[r] for r in sorted(failed)))
        self.control.failure = failure
        raise failure from failure.__cause__

    def _raise_timeout(self, running: list[int]) -> None:
        self.stop()
        for rank in running:
            self._collect(rank)
        timeout = self.timeout or 0.0
        raise LaunchTimeoutError(
            f"the launch did not finish within timeout={timeout:g} s; ranks {running} were still running and "
            "have been stopped. Raise `timeout`, or look for a rank stuck in a collective.",
            timeout,
            tuple(running),
        )

    def stop(self) -> None:
        """SIGTERM every live worker (each then stops what it started), SIGKILL its whole process group if it
        is still alive after ``grace_period`` seconds, reap all; then SIGKILL whatever the finished workers
        left running in their process groups."""
        alive = [(rank, p) for rank, p in enumerate(self.processes) if p.exitcode is None]
        try:
            for rank, process in alive:
                self.stopped.add(rank)
                signal_worker(process, signal.SIGTERM, group=False)
            deadline = time.monotonic() + self.grace_period
            remaining = [rank for rank, _ in alive]
            while remaining and time.monotonic() < deadline:
                wait([self._end(rank) for rank in remaining], timeout=max(0.0, deadline - time.monotonic()))
                remaining = [rank for rank in remaining if self.processes[rank].exitcode is None]
        finally:
            for _, process in alive:
                if process.exitcode is None:
                    signal_worker(process, signal.SIGKILL, group=True)
            for process in self.processes:
                process.join()
                signal_worker(process, signal.SIGKILL, group=True, group_only=True)  # grandchildren left behind
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()
