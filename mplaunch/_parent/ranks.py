"""The one engine: a :class:`Ranks` owns the workers of one start (one per launch attempt; warm workers keep one);
:meth:`Ranks.call` is a call's one loop. A call that ends early stops a launch's ranks (SIGTERM, then SIGKILL after
``grace_period``), or interrupts a warm call (SIGINT; ranks silent for ``grace_period`` are stopped). Follows
CPython's ``concurrent.futures.process`` (one loop on result readers and sentinels) and torch elastic's ``PContext``."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mplaunch._errors import LaunchTimeoutError, StallError, set_attribute
from mplaunch._output.pump import Pump
from mplaunch._output.rank_streams import stdin_for_forks
from mplaunch._parent import stacks
from mplaunch._parent.control import LaunchControl, LaunchStopped
from mplaunch._parent.outcomes import RankState, Stopped, failure_time, rank_state, unreadable_result
from mplaunch._parent.parent_signals import ParentSignalled, signals_held
from mplaunch._parent.prefork import prepare_forks
from mplaunch._parent.processes import open_pidfd, release, start_workers, started_at
from mplaunch._parent.signalling import kill_leftovers, kill_tree, send_signal, signal_worker
from mplaunch._parent.store import Rendezvous
from mplaunch._parent.usage import RankRecords
from mplaunch._platform.proctree import takes_signal
from mplaunch._platform.ready import LONGEST_WAIT, readable
from mplaunch._reports import RankReport
from mplaunch._wire import transport
from mplaunch._wire.board import BEAT, STACKS_SIGNAL, Board
from mplaunch._wire.inherited import InheritedFd
from mplaunch._wire.records import (
    CALL,
    CANCEL,
    DONE,
    ITEM,
    READY,
    Outcome,
    Raised,
    Returned,
    item_name,
    outcome_name,
    result_name,
)
from mplaunch._wire.spec import AttemptSpec, LaunchSpec, WorkerSpec

_INTERRUPTED = 128 + signal.SIGINT  # the exit code a KeyboardInterrupt's record carries
_CLOSED = "the mplaunch.Workers were closed while this call ran; its ranks were stopped"
STARTED = (-1, None)  # what a call yields once its ranks run it, before any value (a stream's call returns then)


class Ranks:
    """The workers of one start; ``warm``: they serve calls; ``outcome_fds``: each rank's outcome file, or ``None``."""

    def __init__(
        self,
        spec: LaunchSpec,
        attempt: AttemptSpec,
        store: Rendezvous | None,
        *,
        outcome_fds: tuple[InheritedFd, ...] | None = None,
        warm: bool = False,
        board: Board | None = None,
        pump: Pump | None = None,
    ) -> None:
        self.spec, self.attempt, self.outcome_fds = spec, attempt, outcome_fds
        self.store, self.warm, self.board, self.pump = store, warm, board, pump
        self.pid = os.getpid()  # the owner: in a process forked from it, this is a copy that acts on nothing
        self.processes: list[BaseProcess] = []
        self.pids: list[int] = []
        self.conns: list[Connection] = []  # by rank, the parent's end of its pipe (warm ranks, a stream's)
        self.ready: set[int] = set()  # the warm ranks that said they are set up
        self.broken = False  # a warm rank died or was stopped: the next call needs new ranks
        self.closing = False  # warm ranks being closed (by another thread, or at exit): a call that runs ends
        self.exits: dict[int, tuple[RankState, float]] = {}  # ranks whose worker ended: state, failure time
        self.stopped: set[int] = set()  # ranks the launch stopped (their end is not a failure of theirs)
        self.killed: set[int] = set()  # ranks killed with their tree after the grace period
        self.records = RankRecords(board, spec.start_method)
        self._pidfds: dict[int, int] = {}
        self._signalling = threading.Lock()  # a stacks request (another thread) against closing the pidfds
        self._dumping = threading.Lock()  # one stacks collection at a time

    def start(
        self,
        target: Callable[..., None],
        payload: Any,
        preload: list[str] = [],  # noqa: B006 - never changed
        conns: Sequence[tuple[Connection, Connection]] = (),
    ) -> None:
        """Start the workers running ``target``; ``conns``: per rank, a pipe (ours, theirs: closed once taken)."""
        spec, nprocs = self.spec, self.spec.nprocs
        self.conns = [ours for ours, _ in conns]
        try:
            with stdin_for_forks(spec.start_method) as stdin:
                # (one outcome file per rank, not the table: a fork server passes at most 256 fds a worker)
                specs = [
                    WorkerSpec(spec, self.attempt, None if self.outcome_fds is None else self.outcome_fds[rank])
                    for rank in range(nprocs)
                ]
                # (under fork: what each rank takes as its stdin, and what the parent made for each)
                forked = prepare_forks(specs[0], stdin) if spec.start_method == "fork" else [None] * nprocs
                rank_args = [(forked[rank], conns[rank][1] if conns else None) for rank in range(nprocs)]
                start_workers(specs, payload, preload, self._started, target=target, rank_args=rank_args)
        finally:
            for _, theirs in conns:
                theirs.close()
        if self.pump is not None:
            self.pump.start()  # drains the pipes; workers are started (no fork while its thread runs)

    def _started(self, process: BaseProcess) -> None:
        """Take the worker just started as the next rank, with a pidfd opened before anything can reap it (a process
        the user forks meanwhile inherits the worker's sentinel and would hold the launch; a pidfd would not)."""
        rank = len(self.processes)
        self.processes.append(process)
        if process.pid is not None:
            self.pids.append(process.pid)
        with contextlib.suppress(AttributeError, OSError):  # no pidfds here: the sentinel it is
            self._pidfds[rank] = open_pidfd(process)
        self.records.started(rank, process.pid, started_at(process))
        if self.pump is not None and process.pid is not None:
            self.pump.pids[rank] = process.pid  # for prefix_output templates with {pid}

    def end_fd(self, rank: int) -> int:
        """Return a descriptor that becomes readable when ``rank``'s worker ends."""
        return self._pidfds.get(rank, self.processes[rank].sentinel)

    def has_ended(self, rank: int) -> bool:
        """Whether ``rank``'s worker has ended (also if someone else reaped it), without reaping it."""
        return rank in self.exits or bool(readable([self.end_fd(rank)], 0))

    def alive(self) -> bool:
        """Whether every worker still runs (none died or was stopped)."""
        return not self.broken and not any(self.has_ended(rank) for rank in range(len(self.processes)))

    def collect(self, rank: int, seen: float | None = None) -> tuple[RankState, float]:
        """Reap ``rank``, read its outcome; return its state and failure time, once; ``seen``: when its end was seen
        (default now: reading takes milliseconds, in which a peer's collective fails of it and seems the earlier)."""
        if rank in self.exits:
            return self.exits[rank]
        process = self.processes[rank]
        seen = time.monotonic() if seen is None else seen
        # a Ctrl-C there would lose the reaped exit code; what unpickling raises is the result's own, never a Ctrl-C
        with signals_held():
            self.records.reap(rank, process, self._pidfds.get(rank))
            try:
                outcome = self._load(rank)
            except BaseException as error:  # noqa: BLE001 - a class this process cannot import, a SystemExit...
                if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
                    raise  # this process's open-files limit, not the result's fault: the launch names the limit
                self.exits[rank] = (unreadable_result(rank, process.pid, error), seen)
                return self.exits[rank]
        if outcome is None and rank not in self.killed and self.attempt.master_port:
            kill_leftovers(rank, self.attempt.master_port)  # it ended without stopping what it started
        oom_kills = self.records.oom_kills(rank)
        state = rank_state(rank, outcome, process.exitcode, process.pid, rank in self.stopped, oom_kills)
        self.exits[rank] = (state, failure_time(outcome, process.exitcode, seen))
        if self.warm:
            self.broken = True
        return self.exits[rank]

    def _load(self, rank: int) -> Outcome | None:
        """Read the outcome ``rank`` left: from its memory file (mapped), or the launch directory (unlinked)."""
        if self.outcome_fds is not None:
            found: Outcome | None = transport.load_fd(self.outcome_fds[rank].fd, result=True, missing_ok=True)
        else:
            found = transport.load(self.spec.directory, outcome_name(rank), private=False, remove=True, missing_ok=True)
        return found

    def stop(self, signum: int | None = signal.SIGTERM) -> None:
        """Send ``signum`` (``None``: none) to live workers, SIGKILL after ``grace_period`` s, reap. Idempotent."""
        if os.getpid() != self.pid:
            return
        alive = [r for r in range(len(self.processes)) if not self.has_ended(r)]
        try:
            for rank in alive:
                if signum is not None:
                    self.stopped.add(rank)
                    signal_worker(self.processes[rank], signum)
                    if not takes_signal(self.pids[rank], signum):  # still starting, it holds it (a spawned rank
                        self.killed.add(rank)  # imports torch): it would die of it, having run none of its code
                        kill_tree(self.processes[rank])
            deadline = time.monotonic() + self.spec.grace_period
            while alive and time.monotonic() < deadline:
                readable([self.end_fd(rank) for rank in alive], max(0.0, deadline - time.monotonic()))
                alive = [rank for rank in alive if not self.has_ended(rank)]
        finally:
            for rank in alive:
                if not self.has_ended(rank):
                    self.killed.add(rank)
                    kill_tree(self.processes[rank])
            with signals_held():
                for rank, process in enumerate(self.processes):
                    self.records.reap(rank, process, self._pidfds.get(rank))
            if self.warm:
                self.broken = True

    def interrupt(self, ranks: Iterable[int], number: int) -> set[int]:
        """Interrupt call ``number`` in the live warm ``ranks`` (``CANCEL``, then SIGINT); return those."""
        interrupted = set()
        for rank in ranks:
            if self.has_ended(rank):
                continue
            interrupted.add(rank)
            with contextlib.suppress(OSError):
                self.conns[rank].send((CANCEL, number))
            signal_worker(self.processes[rank], signal.SIGINT)
        return interrupted

    def stacks(self, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Collect the live ranks' stacks (``ranks``: only these) within ``DUMP_BOUND`` s. Thread-safe."""
        if os.getpid() != self.pid:
            return {}
        with self._dumping:
            wanted = range(len(self.processes)) if ranks is None else ranks
            senders = {rank: functools.partial(self._send_dump, rank) for rank in wanted if rank not in self.exits}
            return stacks.collect(self.spec.directory, senders)

    def _send_dump(self, rank: int) -> None:
        """Signal ``rank``'s worker to dump its stacks (through its pidfd: never another process)."""
        with self._signalling:
            process, pidfd = self.processes[rank], self._pidfds.get(rank)
            if process.pid is None or STACKS_SIGNAL is None or (pidfd is None and rank in self.exits):
                raise ProcessLookupError(process.pid)
            send_signal(process.pid, pidfd, STACKS_SIGNAL)

    def report(self, states: dict[int, RankState] | None = None) -> tuple[RankReport, ...]:
        """Return each rank's report (``states``: the call's, for the out-of-memory verdict)."""
        found = {rank: state for rank, (state, _) in self.exits.items()}
        return self.records.report(self.processes, {**found, **(states or {})}, self.stopped)

    def close(self) -> None:
        """Stop what still runs, close the pipes and pidfds, let go of the processes. Idempotent."""
        self.stop()
        for conn in self.conns:
            conn.close()
        self.conns = []
        with self._signalling:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()
        for process in self.processes:
            release(process)

    def call(
        self,
        number: int,
        control: LaunchControl,
        timeout: float | None,
        stall_timeout: float | None = None,
        start_timeout: float | None = None,
        report_all: bool = False,
    ) -> Generator[tuple[int, Any], None, dict[int, RankState]]:
        """Run call ``number`` (0: a launch's), yielding ``(rank, value)``; return each rank's state, or raise the first
        failure once the others were left; ``timeout`` counts once every warm rank is set up (``start_timeout``)."""
        return _Call(self, number, control, timeout, stall_timeout, start_timeout).run(report_all)


class _Call:
    """The state of one call on a :class:`Ranks` while its loop runs."""

    def __init__(
        self,
        ranks: Ranks,
        number: int,
        control: LaunchControl,
        timeout: float | None,
        stall_timeout: float | None,
        start_timeout: float | None,
    ) -> None:
        self.ranks, self.number, self.control, self.timeout = ranks, number, control, timeout
        self.stall_timeout = stall_timeout if ranks.board is not None else None
        self.left = "interrupted" if ranks.warm else "stopped"  # what leaving the call does to its ranks
        nprocs, self.start_timeout = ranks.spec.nprocs, start_timeout
        self.starting = ranks.warm and len(ranks.ready) < nprocs
        self.start_deadline = time.monotonic() + start_timeout if self.starting and start_timeout else None
        self.pending = set(range(nprocs))
        self.states: dict[int, RankState] = {}
        self.failed_at: dict[int, float] = {}
        self.interrupted: set[int] = set()
        self.closed: set[int] = set()  # ranks whose pipe reached its end (they died): their pidfds tell

    def run(self, report_all: bool) -> Generator[tuple[int, Any], None, dict[int, RankState]]:
        ranks, control = self.ranks, self.control
        if not self.starting:
            control.start_clock(self.timeout)
        if ranks.warm:
            takes_ctrl_c = threading.current_thread() is threading.main_thread()  # else only our CANCEL stops it
            for conn in ranks.conns:
                with contextlib.suppress(OSError):  # a rank that died: its pidfd tells
                    conn.send((CALL, self.number, takes_ctrl_c, report_all))
            if ranks.board is not None:
                for rank in range(ranks.spec.nprocs):  # a beat of an earlier call is not this call's
                    ranks.board.set(rank, BEAT, 0.0)
            yield STARTED  # the ranks run the call whether or not its values are read
        control.stacks_source = ranks.stacks
        try:
            while self.pending:
                if ranks.closing:
                    raise RuntimeError(_CLOSED)
                yield from self._step(self._limit())
                self._check_limits()
                if any(isinstance(state, BaseException) for state in self.states.values()):
                    self._leave()  # the first failure: the ranks still running the call stop
        except ParentSignalled as received:
            self._leave(received.signum, waits=False)  # forwarded: the workers are stopped with the parent's signal
            raise
        except BaseException as error:
            if ranks.closing:  # the ranks are being stopped by whoever closes them
                if isinstance(error, (GeneratorExit, KeyboardInterrupt, RuntimeError)):
                    raise
                raise RuntimeError(_CLOSED) from None
            if os.getpid() == ranks.pid:  # (a forked child collecting its copy of a stream acts on nothing)
                self._leave(waits=not isinstance(error, KeyboardInterrupt))
            raise
        finally:
            control.stacks_source = None
        if ranks.closing:
            raise RuntimeError(_CLOSED)
        return self._outcome()

    def _limit(self) -> float | None:
        """Return the seconds until a deadline, a grace's end or a possible stall, capped at ``LONGEST_WAIT``."""
        control, preemption = self.control, self.control.preemption
        start = None if self.start_deadline is None else max(0.0, self.start_deadline - time.monotonic())
        limits = [control.remaining(), None if preemption is None else preemption.remaining(), start]
        limits.append(self._next_stall_look())
        known = [limit for limit in limits if limit is not None]
        return min(min(known), LONGEST_WAIT) if known else None

    def _step(self, limit: float | None, leaving: bool = False) -> Generator[tuple[int, Any], None, None]:
        """Wait up to ``limit`` s, act on what happened, yield values; ``leaving``: stops, notices no longer count."""
        ends, conns, others = self._watched(leaving)
        ready = set(readable([*ends, *conns, *others], limit))
        seen = time.monotonic()  # when the ends in ready were seen: a rank without an outcome failed then
        for fd, act in others.items():
            if fd in ready:
                act()
        for fd in (fd for fd in conns if fd in ready):
            yield from self._message(conns[fd])
        for rank in (ends[fd] for fd in ends if fd in ready):
            if rank in self.pending and self._said_all(rank):
                self._ended(rank, seen)

    def _said_all(self, rank: int) -> bool:
        """Whether ``rank``'s pipe holds no unread message (its last come before its end; an ended one reads ready)."""
        conns = self.ranks.conns
        return rank in self.closed or not conns or not conns[rank].poll(0)

    def _watched(self, leaving: bool) -> tuple[dict[int, int], dict[int, int], dict[int, Callable[[], None]]]:
        """What to wait on: each pending rank's end and pipe (fd -> rank); the notice, a stop request and the store's
        listener (a worker connected: start the store), in that order, with what to do when one is ready."""
        ranks, control = self.ranks, self.control
        ends = {ranks.end_fd(rank): rank for rank in self.pending}
        conns = {ranks.conns[rank].fileno(): rank for rank in self.pending - self.closed} if ranks.conns else {}
        others: dict[int, Callable[[], None]] = {}
        if not leaving and control.preemption is not None:
            others[control.preemption.fileno()] = control.preemption.drain
        if not leaving and (stop := control.fileno()) is not None:
            others[stop] = _stopped
        if ranks.store is not None and (listener := ranks.store.fileno()) is not None:
            others[listener] = ranks.store.serve
        return ends, conns, others

    def _message(self, rank: int) -> Generator[tuple[int, Any], None, None]:
        """Read and act on one message of ``rank``; yield the value it yielded, if that is what it said."""
        ranks = self.ranks
        try:
            message = ranks.conns[rank].recv()
        except (EOFError, OSError):
            self.closed.add(rank)  # it ended: its pidfd says so
            return
        if message[0] == READY:
            ranks.ready.add(rank)
            if self.starting and len(ranks.ready) == ranks.spec.nprocs:
                self.starting, self.start_deadline = False, None  # every rank is set up: the call's time starts
                self.control.start_clock(self.timeout)
        elif message[0] == ITEM and message[1] == self.number:
            name = item_name(self.number, rank, message[2])
            value = transport.load(ranks.spec.directory, name, private=False, remove=True)
            yield rank, value  # yielded before any interruption reached the rank
        elif message[0] == DONE and message[1] == self.number:
            self._done(rank)

    def _done(self, rank: int) -> None:
        """Read the outcome of this call a warm rank wrote."""
        process = self.ranks.processes[rank]
        self.pending.discard(rank)
        try:
            with signals_held():  # what unpickling raises is the result's own, never a Ctrl-C
                outcome: Outcome = transport.load(
                    self.ranks.spec.directory, result_name(self.number, rank), private=False, remove=True
                )
        except BaseException as error:  # noqa: BLE001 - a class this process cannot import, a SystemExit...
            self.states[rank], self.failed_at[rank] = unreadable_result(rank, process.pid, error), time.monotonic()
            return
        if rank in self.interrupted and isinstance(outcome, Raised) and outcome.exit_code == _INTERRUPTED:
            self.states[rank] = Stopped(rank)
            return
        if isinstance(outcome, Raised):
            self.failed_at[rank] = outcome.when
        self.states[rank] = rank_state(rank, outcome, 0, process.pid, False)

    def _ended(self, rank: int, seen: float | None = None) -> None:
        """Collect ``rank``'s worker, which ended during the call."""
        self.pending.discard(rank)
        self.states[rank], self.failed_at[rank] = self.ranks.collect(rank, seen)

    def _check_limits(self) -> None:
        """Act on a passed limit: a preemption's grace, the start deadline, the deadline, a stall."""
        preemption, control = self.control.preemption, self.control
        if preemption is not None and preemption.noticed and self.pending:
            if preemption.remaining() == 0.0 or control.remaining() == 0.0:
                self._leave()  # the grace (or the timeout in it) is over, or a second notice came
        elif self.start_deadline is not None and time.monotonic() >= self.start_deadline:
            self.ranks.stop()  # a rank still importing would die of a SIGINT, printing a traceback
            timeout, starting = self.start_timeout or 0.0, sorted(set(range(self.ranks.spec.nprocs)) - self.ranks.ready)
            raise LaunchTimeoutError(
                f"ranks {starting} did not finish starting within rdzv_timeout={timeout:g} s; every rank has been "
                "stopped, and the next call starts them again. Raise `rdzv_timeout`, or look for a rank stuck while "
                "importing or joining its process group.",
                timeout,
                tuple(starting),
            )
        elif control.remaining() == 0.0 and self.pending:
            found, running = self._stacks(), sorted(self.pending)
            message = (
                f"the {'call' if self.ranks.warm else 'launch'} did not finish within timeout={self.timeout or 0.0:g} "
                f"s; ranks {running} were still running and have been {self.left}."
                f"{_where(found, self.ranks.spec.log_dir, running)} Raise `timeout`, or look for a rank stuck in a "
                "collective."
            )
            raise LaunchTimeoutError(message, self.timeout or 0.0, tuple(running), found)
        elif preemption is None or not preemption.noticed:  # saving may be silent: the grace bounds it
            self._check_stalls()

    def _next_stall_look(self) -> float | None:
        """Return the seconds until a running rank could be stalled, else ``None``."""
        board = self.ranks.board
        if self.stall_timeout is None or board is None:
            return None
        now = time.monotonic()
        beats = [beat for rank in self.pending if (beat := board.get(rank, BEAT)) > 0.0]
        # none beating yet: a rank that beats now could be stalled in stall_timeout seconds, no sooner
        due = min((beat + self.stall_timeout - now for beat in beats), default=self.stall_timeout)
        return max(due, 0.0) + 0.005

    def _check_stalls(self) -> None:
        """Raise :class:`StallError` for the most silent rank silent for ``stall_timeout`` seconds."""
        board = self.ranks.board
        if self.stall_timeout is None or board is None:
            return
        now = time.monotonic()
        silent = [(now - beat, rank) for rank in self.pending if (beat := board.get(rank, BEAT)) > 0.0]
        stalled = [(seconds, rank) for seconds, rank in silent if seconds >= self.stall_timeout]
        if not stalled:
            return
        seconds, rank = max(stalled, key=lambda found: (found[0], -found[1]))
        pid, running, found = self.ranks.processes[rank].pid, sorted(self.pending), self._stacks()
        message = (
            f"rank {rank} (pid {pid}) stalled: its last mplaunch.heartbeat() was {seconds:.1f} s ago, more than "
            f"stall_timeout={self.stall_timeout:g} s; every rank has been {self.left}."
            f"{_where(found, self.ranks.spec.log_dir, running)}"
        )
        failure = StallError(message, rank, pid, seconds, self.stall_timeout, found)
        self.control.failure = failure
        raise failure

    def _stacks(self) -> dict[int, str]:
        """Collect the running ranks' stacks, also written to ``log_dir``."""
        found = self.ranks.stacks(sorted(self.pending))
        stacks.write_to_log_dir(self.ranks.spec.log_dir, found)
        return found

    def _leave(self, signum: int = signal.SIGTERM, waits: bool = True) -> None:
        """Leave the call's running ranks: a launch's stopped by ``signum``; a warm call interrupted (then stopped)."""
        ranks = self.ranks
        # a rank still starting (SIGINT held) skips the cancelled call once started: waited for, but not after a Ctrl-C
        answers = waits or all(
            r in ranks.ready or takes_signal(ranks.pids[r], signal.SIGINT, True) for r in self.pending
        )
        if ranks.warm and self.pending and answers:
            self.interrupted |= ranks.interrupt(self.pending - self.interrupted, self.number)
            deadline = time.monotonic() + ranks.spec.grace_period
            while self.pending and time.monotonic() < deadline:
                for _ in self._step(max(0.0, deadline - time.monotonic()), leaving=True):
                    pass  # a value yielded while the call is left is dropped
            signum = signal.SIGTERM  # those that did not answer are stopped as a launch's are
        if self.pending:
            ranks.stop(signum)
            for rank in sorted(self.pending):
                self._ended(rank)

    def _outcome(self) -> dict[int, RankState]:
        """Return each rank's state, or raise the preemption or the first failure."""
        preemption = self.control.preemption
        if preemption is not None and preemption.noticed:
            raise preemption.error(self.states, self.ranks.spec.nprocs)
        failures = {rank: state for rank, state in self.states.items() if isinstance(state, BaseException)}
        if failures:
            first = min(failures, key=lambda rank: (self.failed_at.get(rank, float("inf")), rank))
            failure = failures.pop(first)
            set_attribute(failure, "failures", tuple(failures[rank] for rank in sorted(failures)))
            self.control.failure = failure
            raise failure from failure.__cause__
        return self.states


@contextlib.contextmanager
def board_for(directory: str, nprocs: int, wanted: bool) -> Iterator[Board | None]:
    """Yield a zeroed board if ``wanted`` and possible, else ``None`` (the ranks run unwatched); unmap it after."""
    board = None
    if wanted:
        with contextlib.suppress(OSError, ValueError):
            board = Board(directory, nprocs, create=True)
    try:
        yield board
    finally:
        if board is not None:
            board.close()


def _stopped() -> None:
    raise LaunchStopped()


def values(states: dict[int, RankState], nprocs: int) -> list[Any]:
    """Return the reporting ranks' values in rank order (``None`` for the others)."""
    return [state.value if isinstance(state := states.get(rank), Returned) else None for rank in range(nprocs)]


def _where(found: dict[int, str], log_dir: str | None, running: list[int]) -> str:
    """Return the sentences of an error message that say where each rank was."""
    missing = [rank for rank in running if rank not in found]
    silent = f" Ranks {missing} sent no stacks (still starting, or no dump within 1 s)." if missing else ""
    if not found:
        return silent
    kept = f" and in {os.path.join(log_dir, 'rank{N}.stacks')} (N: the rank)" if log_dir is not None else ""
    where = f" Where each rank was: {stacks.summary(found)} (every thread's stack is on the error's `stacks`{kept})."
    return where + silent
