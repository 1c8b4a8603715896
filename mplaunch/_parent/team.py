"""One set of warm workers (:class:`mplaunch.Workers`) as started: their processes, control pipes, launch
directory, rendezvous store and output pump, and the exchange of one call with them.

A call is written once to the launch directory (:func:`~mplaunch._wire.transport.dump`, one copy); each rank
is told on its pipe, and answers on it when a value was yielded or the outcome is written, the objects
themselves again as files. The parent waits on the pipes and on a pidfd per worker at once, so a rank that
dies is seen at once. A call that is abandoned (Ctrl-C, a failed peer, a closed stream, a timeout) is
interrupted in the ranks still running it: a CANCEL message, then SIGINT to the rank's main thread; a rank
that has not answered within ``grace_period`` seconds is stopped with the others (SIGTERM, then SIGKILL), and
the next call starts them all again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Generator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from mplaunch._config import ParallelConfig
from mplaunch._errors import LaunchTimeoutError, RemoteError
from mplaunch._output.pump import Pump, routed, worker_fds
from mplaunch._parent import policy
from mplaunch._parent.control import LaunchStopped
from mplaunch._parent.directory import launch_directory
from mplaunch._parent.processes import signal_worker, start_workers
from mplaunch._parent.signals import signals_held
from mplaunch._parent.store import rendezvous
from mplaunch._state.python import warn_not_carried
from mplaunch._state.snapshot import ForkState, GlobalState
from mplaunch._wire import transport
from mplaunch._wire.importable import worker_imports
from mplaunch._wire.records import (
    CALL,
    CANCEL,
    DONE,
    EXIT,
    ITEM,
    PAYLOAD,
    Outcome,
    Payload,
    Raised,
    RankState,
    Stopped,
    WorkerSpec,
    item_name,
    outcome_name,
    rank_state,
    result_name,
)
from mplaunch._worker.serve import serve

T = TypeVar("T")
_INTERRUPTED = 128 + signal.SIGINT  # the exit code a KeyboardInterrupt's record carries


class Team:
    """Warm workers as started once; :meth:`exchange` runs one call, :meth:`close` ends them.

    Attributes:
        spec: their spec (directory, nprocs, start method, reporting ranks, ...).
        processes: the workers, by rank.
        broken: a worker died or was stopped: the next call needs a new team.
    """

    def __init__(self, config: ParallelConfig, nprocs: int, start_method: str) -> None:
        self.processes: list[BaseProcess] = []
        self.broken = False
        self.failed_at: dict[int, float] = {}  # in the last call: when each failed rank raised or ended
        self._conns: list[Connection] = []
        self._pidfds: list[int] = []
        self._stack = contextlib.ExitStack()
        self._closed = False
        self.pump: Pump | None = None
        try:
            self._start(config, nprocs, start_method)
        except BaseException:
            self.close()
            raise

    def _start(self, config: ParallelConfig, nprocs: int, start_method: str) -> None:
        stack = self._stack
        directory = stack.enter_context(launch_directory())
        backend = policy.resolve_backend(config.backend, nprocs)
        self.store = stack.enter_context(rendezvous(lazy=backend is None))
        spec = WorkerSpec(
            directory=directory,
            nprocs=nprocs,
            start_method=start_method,
            parent_pid=os.getpid(),
            num_threads=policy.worker_threads(nprocs, start_method),
            reporting_ranks=frozenset(range(nprocs)) if config.return_all else frozenset({0}),
            environ=dict(os.environ) if start_method == "forkserver" else None,
            backend=backend,
            prefix_output=config.prefix_output,
            post_mortem=config.post_mortem,
            console_ranks=config.console_ranks,
            log_dir=config.log_dir,
            grace_period=config.grace_period,
            mp_start_method=multiprocessing.get_start_method(allow_none=True),
            unshare=False,
            master_addr=self.store.addr,
            master_port=self.store.port,
            agent_store=self.store.agent_store,
        )
        self.pump = pump = stack.enter_context(routed(list(range(nprocs)), spec))
        self.spec = spec = dataclasses.replace(spec, output_fds=worker_fds(pump, start_method, nprocs))
        state: GlobalState | ForkState
        payload: Payload | None = None
        if start_method == "fork":
            payload = Payload(None, (), {}, ForkState.capture())  # type: ignore[arg-type]
        else:
            state = GlobalState.capture()
            if state.python is not None:
                warn_not_carried(state.python)
            transport.dump(Payload(None, (), {}, state), directory, PAYLOAD, imports=worker_imports())  # type: ignore[arg-type]
        pipes = [multiprocessing.Pipe(duplex=True) for _ in range(nprocs)]
        self._conns = [ours for ours, _ in pipes]
        try:
            in_starter(
                lambda: start_workers(
                    spec, payload, [], self._started, target=serve, rank_args=[(theirs,) for _, theirs in pipes]
                )
            )
        finally:
            for _, theirs in pipes:
                theirs.close()
        if pump is not None:
            pump.start()

    def _started(self, process: BaseProcess) -> None:
        self.processes.append(process)
        try:
            self._pidfds.append(os.pidfd_open(process.pid))  # type: ignore[arg-type]
        except (AttributeError, OSError):
            self._pidfds.append(process.sentinel)

    def alive(self) -> bool:
        """Whether every worker still runs (none died or was stopped between calls)."""
        return not self.broken and not self._closed and all(p.exitcode is None and p.is_alive() for p in self.processes)

    def exchange(
        self, number: int, stop: int | None, timeout: float | None
    ) -> Generator[tuple[int, Any], None, dict[int, RankState]]:
        """Tell every rank to run call ``number`` (already written); yield ``(rank, value)`` for each value a
        reporting rank yields, as it comes; return each rank's state once all have answered.

        A failure (a rank raising, or dying) interrupts the ranks still running; ``stop`` (a descriptor)
        becoming readable, ``timeout`` seconds passing, or the generator being closed or interrupted (Ctrl-C)
        interrupts every rank still running, then raises (``LaunchStopped``, ``LaunchTimeoutError``,
        ``GeneratorExit``, ``KeyboardInterrupt``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.failed_at = {}
        pending = set(range(self.spec.nprocs))
        states: dict[int, RankState] = {}
        interrupted: set[int] = set()
        grace: float | None = None  # once interrupted: when the ranks must have answered
        if self.pump is not None:
            self.pump.retarget()  # this call's output goes where the caller's would (its notebook cell)
        for conn in self._conns:
            conn.send((CALL, number))
        try:
            while pending:
                ends = {self._pidfds[rank]: rank for rank in pending}
                conns = {self._conns[rank]: rank for rank in pending}
                listener = self.store.fileno()
                watched: list[Any] = [*conns, *ends, *(fd for fd in (stop, listener) if fd is not None)]
                limit = min((t for t in (deadline, grace) if t is not None), default=None)
                ready = wait(watched, timeout=None if limit is None else max(0.0, limit - time.monotonic()))
                if not ready:
                    if grace is not None and time.monotonic() >= grace:
                        self.terminate()
                        break
                    raise _timeout_error(timeout or 0.0, sorted(pending))
                if stop is not None and stop in ready:
                    raise LaunchStopped()
                if listener is not None and listener in ready:
                    self.store.serve()
                for conn in (c for c in ready if c in conns):
                    rank = conns[conn]
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        continue  # it ended: its pidfd says so
                    if message[0] == ITEM and message[1] == number:
                        name = item_name(number, rank, message[2])
                        value = transport.load(self.spec.directory, name, private=False, remove=True)
                        yield rank, value  # yielded before any interruption reached the rank
                        del value
                    elif message[0] == DONE and message[1] == number:
                        pending.discard(rank)
                        states[rank] = self._result(number, rank, rank in interrupted)
                for end in (e for e in ready if e in ends and ends[e] in pending):
                    rank = ends[end]
                    if self._conns[rank].poll(0):
                        continue  # its last messages first
                    pending.discard(rank)
                    states[rank] = self._ended(rank, rank in interrupted)
                    self.broken = True
                if grace is None and any(isinstance(s, BaseException) for s in states.values()) and pending:
                    grace = self._interrupt(pending, number, interrupted)
        except BaseException:
            if pending and not self._closed:  # closed (at exit, or by another thread): nothing left to stop
                self._abandon(pending, number, interrupted)
            raise
        finally:
            self._clean(number)
            if self.pump is not None and not self._closed:
                self.pump.sync()  # the call's output before its value
        for rank in range(self.spec.nprocs):
            states.setdefault(rank, Stopped(rank))
        return states

    def _result(self, number: int, rank: int, interrupted: bool) -> RankState:
        """Read rank ``rank``'s outcome of call ``number``."""
        process = self.processes[rank]
        try:
            outcome: Outcome = transport.load(
                self.spec.directory, result_name(number, rank), private=False, remove=True
            )
        except Exception as error:  # noqa: BLE001 - e.g. a result class that this process cannot import
            failure = RemoteError(
                f"rank {rank} (pid {process.pid}) returned a result that cannot be unpickled in the parent: "
                f"{type(error).__name__}: {error}",
                rank,
                process.pid,
                type(error).__qualname__,
            )
            failure.__cause__ = error
            return failure
        if interrupted and isinstance(outcome, Raised) and outcome.exit_code == _INTERRUPTED:
            return Stopped(rank)
        if isinstance(outcome, Raised):
            self.failed_at[rank] = outcome.when
        return rank_state(rank, outcome, 0, process.pid, False)

    def _ended(self, rank: int, stopped: bool) -> RankState:
        """The state of a rank whose worker ended during a call."""
        process = self.processes[rank]
        with signals_held():
            process.join()
        try:
            outcome = transport.load(
                self.spec.directory, outcome_name(rank), private=False, remove=True, missing_ok=True
            )
        except Exception:  # noqa: BLE001 - judged by its exit code alone
            outcome = None
        self.failed_at[rank] = outcome.when if isinstance(outcome, Raised) else time.monotonic()
        return rank_state(rank, outcome, process.exitcode, process.pid, stopped)

    def _interrupt(self, ranks: set[int], number: int, interrupted: set[int]) -> float:
        """Interrupt call ``number`` in ``ranks``; return by when they must have answered."""
        for rank in ranks - interrupted:
            interrupted.add(rank)
            with contextlib.suppress(OSError):
                self._conns[rank].send((CANCEL, number))
            signal_worker(self.processes[rank], signal.SIGINT, group=False)
        return time.monotonic() + self.spec.grace_period

    def _abandon(self, pending: set[int], number: int, interrupted: set[int]) -> None:
        """Interrupt the call in ``pending`` and wait for their answers (discarded); stop the workers if they
        do not answer within ``grace_period`` seconds, or on a second Ctrl-C."""
        try:
            deadline = self._interrupt(pending, number, interrupted)
            while pending and time.monotonic() < deadline:
                conns = {self._conns[rank]: rank for rank in pending}
                ends = {self._pidfds[rank]: rank for rank in pending}
                watched: list[Any] = [*conns, *ends]
                for ready in wait(watched, timeout=max(0.0, deadline - time.monotonic())):
                    if isinstance(ready, int):
                        pending.discard(ends[ready])
                        self.broken = True
                        continue
                    assert isinstance(ready, Connection)
                    with contextlib.suppress(EOFError, OSError):
                        if ready.recv()[:2] == (DONE, number):
                            pending.discard(conns[ready])
        finally:
            if pending:
                self.terminate()

    def _clean(self, number: int) -> None:
        """Remove what call ``number`` left in the launch directory (values nobody read, the call)."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.spec.directory, "post-mortem"))  # the next call's failure may debug
        prefixes = (
            f"call{number}.",
            f".call{number}.",
            f"item{number}-",
            f".item{number}-",
            f"result{number}-",
            f".result{number}-",
        )
        with contextlib.suppress(OSError):
            for entry in os.listdir(self.spec.directory):
                if entry.startswith(prefixes):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.spec.directory, entry))

    def terminate(self) -> None:
        """Stop every worker: SIGTERM, SIGKILL to its process group after ``grace_period`` seconds; reap."""
        self.broken = True
        if self._closed:
            return
        alive = [p for p in self.processes if p.exitcode is None]
        for process in alive:
            signal_worker(process, signal.SIGTERM, group=False)
        self._reap(alive)

    def _reap(self, alive: list[BaseProcess]) -> None:
        deadline = time.monotonic() + self.spec.grace_period
        try:
            while any(p.exitcode is None for p in alive) and time.monotonic() < deadline:
                ends = [self._pidfds[self.processes.index(p)] for p in alive if p.exitcode is None]
                wait(ends, timeout=max(0.0, deadline - time.monotonic()))
                for process in alive:
                    with signals_held():
                        process.join(0)
        finally:
            for process in self.processes:
                if process.exitcode is None:
                    signal_worker(process, signal.SIGKILL, group=True)
                process.join()
                signal_worker(process, signal.SIGKILL, group=True, group_only=True)  # what it left running

    def close(self) -> None:
        """Tell the workers to leave, wait ``grace_period`` seconds for them, stop those still running, and
        remove everything: pipes, pidfds, the store, the output pump, the launch directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send((EXIT,))
            self._reap([p for p in self.processes if p.exitcode is None])
        finally:
            for conn in self._conns:
                conn.close()
            for fd in self._pidfds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for process in self.processes:
                with contextlib.suppress(ValueError):
                    process.close()
            self._stack.close()


_jobs: queue.SimpleQueue[tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]] = queue.SimpleQueue()
_starter: threading.Thread | None = None
_starter_lock = threading.Lock()


def in_starter(job: Callable[[], T]) -> T:
    """Run ``job`` (which starts processes) in one long-lived thread and return its value or raise its error.

    A worker's ``PR_SET_PDEATHSIG`` fires when the *thread* that forked it ends, so warm workers must not be
    started from a thread that ends before them (a ``submit()``'s)."""
    global _starter
    with _starter_lock:
        if _starter is None or not _starter.is_alive():
            _starter = threading.Thread(target=_serve_jobs, name="mplaunch-starter", daemon=True)
            _starter.start()
    answer: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
    _jobs.put((job, answer))
    try:
        ok, value = answer.get()
    except KeyboardInterrupt:  # the start goes on in the starter: wait for it, so it can be undone
        ok, value = answer.get()
        raise
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _serve_jobs() -> None:
    while True:
        job, answer = _jobs.get()
        try:
            answer.put((True, job()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            answer.put((False, error))
        del job, answer


def _timeout_error(timeout: float, running: list[int]) -> LaunchTimeoutError:
    """The error of a call that ran past ``timeout`` seconds."""
    return LaunchTimeoutError(
        f"the call did not finish within timeout={timeout:g} s; ranks {running} were still running and have "
        "been interrupted. Raise `timeout`, or look for a rank stuck in a collective.",
        timeout,
        tuple(running),
    )
