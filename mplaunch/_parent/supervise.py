"""Watching the workers of one launch: reading their outcomes, stopping them, raising the first failure."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
import time
from collections.abc import Iterable
from multiprocessing.process import BaseProcess
from typing import Any

from mplaunch._errors import LaunchTimeoutError, StallError
from mplaunch._parent import stacks
from mplaunch._parent.control import LaunchControl, LaunchStopped
from mplaunch._parent.processes import open_pidfd, started_at
from mplaunch._parent.report import RankRecords, RankReport
from mplaunch._parent.signalling import kill_leftovers, kill_tree, send_signal, signal_worker
from mplaunch._parent.signals import signals_held
from mplaunch._parent.store import Rendezvous
from mplaunch._platform.ready import readable
from mplaunch._wire import transport
from mplaunch._wire.records import (
    Outcome,
    RankState,
    Returned,
    WorkerSpec,
    failure_time,
    outcome_name,
    rank_state,
    set_attribute,
    unreadable_result,
)
from mplaunch._wire.watch import BEAT, STACKS_SIGNAL, Board


def _earliest(*seconds: float | None) -> float | None:
    """The shortest of these waits (``None``: no limit)."""
    known = [s for s in seconds if s is not None]
    return min(known) if known else None


class Supervisor:
    """Waits for the workers of one launch, reads their outcomes, and stops them all.

    Args:
        spec: the launch's worker spec (directory, nprocs, reporting ranks).
        processes: the started workers, indexed by rank (filled in by the launcher as they start).
        timeout: seconds the whole launch may take, or ``None``.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        control: the launch's deadline (shared by all its attempts) and stop request.
        store: the launch's rendezvous; its store is started when a worker first connects.
        stall_timeout: seconds a rank that has beaten may stay silent, or ``None``.
        board: the attempt's board (heartbeats, usage), or ``None``.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        processes: list[BaseProcess],
        timeout: float | None,
        grace_period: float,
        control: LaunchControl | None = None,
        store: Rendezvous | None = None,
        stall_timeout: float | None = None,
        board: Board | None = None,
    ) -> None:
        self.spec = spec
        self.store = store
        self.control = control or LaunchControl()
        self.processes = processes
        self.timeout = timeout
        self.grace_period = grace_period
        self.states: dict[int, RankState] = {}
        self.stopped: set[int] = set()
        self.killed: set[int] = set()  # ranks killed with their tree (kill_tree)
        self.failed_at: dict[int, float] = {}  # when each rank failed (raised, or was seen to end)
        self._pidfds: dict[int, int] = {}  # rank -> a pidfd of its worker (see started)
        self.stall_timeout = stall_timeout
        self.board = board
        self.records = RankRecords(board, spec.start_method)
        self._signalling = threading.Lock()  # a stacks request (another thread) against closing the pidfds
        self._dumping = threading.Lock()  # one stacks collection at a time

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
            self._pidfds[len(self.processes) - 1] = open_pidfd(process)
        self.records.started(len(self.processes) - 1, process.pid, started_at(process))

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
        self.control.stacks_source = self.stacks
        try:
            self._wait({self._end(rank): rank for rank in range(len(self.processes))}, stop, listener)
        finally:
            self.control.stacks_source = None
        preemption = self.control.preemption
        if preemption is not None and preemption.noticed:
            raise preemption.error(self.states, self.spec.nprocs)
        return [state.value if isinstance(state := self.states[r], Returned) else None for r in range(self.spec.nprocs)]

    def _wait(self, pending: dict[int, int], stop: int | None, listener: int | None) -> None:
        """Collect each worker as its end becomes readable (``pending``: descriptor -> rank); start the store
        when ``listener`` is; raise as :meth:`wait` says."""
        preemption = self.control.preemption
        notice = None if preemption is None else preemption.fileno()
        while pending:
            watched = [*pending, *(fd for fd in (stop, listener, notice) if fd is not None)]
            grace = preemption.remaining() if preemption else None
            ready = readable(watched, _earliest(self._next_look(pending.values()), grace))
            seen = time.monotonic()  # when the ends in ready were seen: a rank without an outcome failed then
            if preemption is not None and preemption.noticed:
                if preemption.remaining() == 0.0 or self.control.remaining() == 0.0:
                    self._raise_preempted()  # the grace (or the timeout in it) is over, or a second notice came
            if not ready:
                if self.control.remaining() == 0.0:
                    self._raise_timeout(sorted(pending.values()))
                if preemption is None or not preemption.noticed:  # saving may be silent: the grace bounds it
                    self._check_stalls(sorted(pending.values()))
                continue
            if notice in ready and preemption is not None:
                preemption.drain()  # the first notice: the ranks are told through the flag, and wait()'s timeout
            if stop in ready:
                raise LaunchStopped()  # the caller's clean-up stops the workers
            if listener in ready and self.store is not None:
                self.store.serve()  # a worker connected: start the store it waits for
                listener = None
            for sentinel in (fd for fd in ready if fd in pending):
                rank = pending.pop(sentinel)
                state = self._collect(rank, seen)
                if isinstance(state, BaseException):
                    if preemption is not None and preemption.noticed:
                        self._raise_preempted()  # a failure while saving: preempted all the same
                    self._raise_failure(state, rank)

    def _collect(self, rank: int, seen: float | None = None) -> RankState:
        """Read the outcome of a finished worker and decide its state. ``seen``: when its end was seen
        (``time.monotonic()``; default now), the time of its failure if it left no outcome (a signal killed
        it): reaping it and reading what it left takes milliseconds, in which a peer's collective can fail
        because of its death and would seem the earlier failure."""
        process = self.processes[rank]
        # a Ctrl-C there would lose the exit code of the worker it reaps; what unpickling raises is the
        # result's own, never a Ctrl-C
        with signals_held():
            self.records.reap(rank, process, self._pidfds.get(rank))
            try:
                outcome = self._load(rank)
            except BaseException as error:  # noqa: BLE001 - a class this process cannot import, a SystemExit...
                if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
                    raise  # this process's open-files limit, not the result's fault: the launch names the limit
                failure = unreadable_result(rank, process.pid, error)
                self.states[rank] = failure
                return failure
        if outcome is None and rank not in self.killed and self.spec.master_port:
            kill_leftovers(rank, self.spec.master_port)  # it ended without stopping what it started
        oom_kills = self.records.oom_kills(rank)
        state = rank_state(rank, outcome, process.exitcode, process.pid, rank in self.stopped, oom_kills)
        self.states[rank] = state
        ended = time.monotonic() if seen is None else seen
        self.failed_at[rank] = failure_time(outcome, process.exitcode, ended)
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

    def _raise_preempted(self) -> None:
        """Stop the ranks still running and raise the :class:`~mplaunch.PreemptedError`."""
        preemption = self.control.preemption
        assert preemption is not None
        self.stop()
        for rank in range(self.spec.nprocs):
            if rank not in self.states and rank < len(self.processes):
                self._collect(rank)
        raise preemption.error(self.states, self.spec.nprocs)

    def _raise_timeout(self, running: list[int]) -> None:
        found = self._stacks_before_stop(running)
        timeout = self.timeout or 0.0
        where = _where(found, self.spec.log_dir, running)
        raise LaunchTimeoutError(
            f"the launch did not finish within timeout={timeout:g} s; ranks {running} were still running and "
            f"have been stopped.{where} Raise `timeout`, or look for a rank stuck in a collective.",
            timeout,
            tuple(running),
            found,
        )

    def _next_look(self, running: Iterable[int]) -> float | None:
        """Seconds until the deadline or the next moment a running rank could be stalled, else ``None``."""
        remaining = self.control.remaining()
        if self.stall_timeout is None or self.board is None:
            return remaining
        now = time.monotonic()
        beats = [beat for rank in running if (beat := self.board.get(rank, BEAT)) > 0.0]
        # none beating yet: a rank that beats now could be stalled in stall_timeout seconds, no sooner
        due = min((beat + self.stall_timeout - now for beat in beats), default=self.stall_timeout)
        due = max(due, 0.0) + 0.005
        return due if remaining is None else min(due, remaining)

    def _check_stalls(self, running: list[int]) -> None:
        """Raise :class:`StallError` for the most silent running rank silent for ``stall_timeout`` seconds."""
        if self.stall_timeout is None or self.board is None:
            return
        now = time.monotonic()
        silent = [(now - beat, rank) for rank in running if (beat := self.board.get(rank, BEAT)) > 0.0]
        stalled = [(seconds, rank) for seconds, rank in silent if seconds >= self.stall_timeout]
        if not stalled:
            return
        seconds, rank = max(stalled, key=lambda found: (found[0], -found[1]))
        pid = self.processes[rank].pid
        found = self._stacks_before_stop(running)
        where = _where(found, self.spec.log_dir, running)
        failure = StallError(
            f"rank {rank} (pid {pid}) stalled: its last mplaunch.heartbeat() was {seconds:.1f} s ago, more than "
            f"stall_timeout={self.stall_timeout:g} s; every worker has been stopped.{where}",
            rank,
            pid,
            seconds,
            self.stall_timeout,
            found,
        )
        self.control.failure = failure
        raise failure

    def _stacks_before_stop(self, running: list[int]) -> dict[int, str]:
        """Collect the running ranks' stacks (at most ``DUMP_BOUND`` seconds), write them to ``log_dir``, then
        stop every worker and collect the running ranks' ends."""
        try:
            found = self.stacks(running)
            stacks.write_to_log_dir(self.spec.log_dir, found)
        finally:
            self.stop()
            for rank in running:
                self._collect(rank)
        return found

    def stacks(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Every running rank's Python stacks (all threads), by rank, within ``DUMP_BOUND`` seconds; the
        workers keep running. ``ranks``: only these. Thread-safe."""
        with self._dumping:
            wanted = range(len(self.processes)) if ranks is None else ranks
            senders = {rank: functools.partial(self._send_dump, rank) for rank in wanted if rank not in self.states}
            return stacks.collect(self.spec.directory, senders)

    def _send_dump(self, rank: int) -> None:
        """Signal ``rank``'s worker to dump its stacks (through its pidfd: never another process)."""
        with self._signalling:
            process, pidfd = self.processes[rank], self._pidfds.get(rank)
            if process.pid is None or STACKS_SIGNAL is None or (pidfd is None and rank in self.states):
                raise ProcessLookupError(process.pid)
            send_signal(process.pid, pidfd, STACKS_SIGNAL)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` (SIGTERM, or the signal the parent got and forwards) to every live worker (each then
        stops what it started); SIGKILL a worker still alive after ``grace_period`` seconds with everything it
        started (:func:`~mplaunch._parent.signalling.kill_tree`); reap all."""
        # (a rank with a state was collected: it has ended)
        alive = [(r, p) for r, p in enumerate(self.processes) if r not in self.states and not _ended(self._end(r))]
        try:
            for rank, process in alive:
                self.stopped.add(rank)
                signal_worker(process, signum)
            deadline = time.monotonic() + self.grace_period
            remaining = [rank for rank, _ in alive]
            while remaining and time.monotonic() < deadline:
                readable([self._end(rank) for rank in remaining], max(0.0, deadline - time.monotonic()))
                remaining = [rank for rank in remaining if not _ended(self._end(rank))]
        finally:
            for rank, process in alive:
                if not _ended(self._end(rank)):
                    self.killed.add(rank)
                    kill_tree(process)
            with signals_held():
                for rank, process in enumerate(self.processes):
                    self.records.reap(rank, process, self._pidfds.get(rank))
            with self._signalling:
                for fd in self._pidfds.values():
                    os.close(fd)
                self._pidfds.clear()

    def report(self) -> tuple[RankReport, ...]:
        """Each rank's :class:`~mplaunch.RankReport` (call after :meth:`stop`)."""
        return self.records.report(self.processes, self.states, self.stopped)


def _ended(fd: int) -> bool:
    """Whether the worker whose end ``fd`` (pidfd or sentinel) signals has ended, without reaping it."""
    return bool(readable([fd], 0))


def _where(found: dict[int, str], log_dir: str | None, running: list[int]) -> str:
    """The sentences of an error message that say where each rank was, from their stacks."""
    missing = [rank for rank in running if rank not in found]
    silent = f" Ranks {missing} sent no stacks (still starting, or no dump within 1 s)." if missing else ""
    if not found:
        return silent
    kept = f" and in {os.path.join(log_dir, 'rank{N}.stacks')} (N: the rank)" if log_dir is not None else ""
    where = f" Where each rank was: {stacks.summary(found)} (every thread's stack is on the error's `stacks`{kept})."
    return where + silent
