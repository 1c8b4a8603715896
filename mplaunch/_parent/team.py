"""One set of warm workers (:class:`mplaunch.Workers`) as started: their processes, control pipes, launch
directory, rendezvous store and output pump; and what a ``Workers`` object holds, apart from itself, so that
its finalizer and the interpreter's exit can close them.

The workers are started as a launch's are (the same spec, environment, output, store, directory and reaper),
from one long-lived thread (:mod:`mplaunch._parent.starter`). A call is exchanged with them by
:mod:`mplaunch._parent.exchange`. Closing tells each to leave (its exit handlers run), then stops those still
running after ``grace_period`` seconds (SIGTERM, then SIGKILL to its process group).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from mplaunch._config import ParallelConfig
from mplaunch._output.pump import Pump, routed, worker_fds
from mplaunch._parent import policy, stacks
from mplaunch._parent.directory import launch_directory
from mplaunch._parent.processes import open_pidfd, release, start_workers
from mplaunch._parent.signalling import kill_tree, send_signal, signal_worker
from mplaunch._parent.signals import signals_held
from mplaunch._parent.starter import in_starter
from mplaunch._parent.store import rendezvous
from mplaunch._platform import forks
from mplaunch._platform.pidfd import reaped_status
from mplaunch._platform.ready import readable
from mplaunch._state.python import warn_not_carried
from mplaunch._state.snapshot import ForkState, GlobalState
from mplaunch._wire import transport
from mplaunch._wire.importable import worker_imports
from mplaunch._wire.records import EXIT, PAYLOAD, Payload, WorkerSpec
from mplaunch._wire.watch import STACKS_SIGNAL
from mplaunch._worker.serve import serve

if TYPE_CHECKING:
    from mplaunch._parent.stream import Stream


class Team:
    """Warm workers as started once; :meth:`exchange` runs one call, :meth:`close` ends them.

    Attributes:
        spec: their spec (directory, nprocs, start method, reporting ranks, ...).
        processes: the workers, by rank.
        broken: a worker died or was stopped: the next call needs a new team.
    """

    def __init__(self, config: ParallelConfig, nprocs: int, start_method: str) -> None:
        self.pid = os.getpid()  # the owner: in a process forked from it, the team is a copy that acts on nothing
        self.processes: list[BaseProcess] = []
        self.broken = False
        self.failed_at: dict[int, float] = {}  # in the last call: when each failed rank raised or ended
        self.conns: list[Connection] = []  # by rank: the parent's end of its control pipe
        self.ends: list[int] = []  # by rank: a pidfd (or multiprocessing's sentinel), readable once it ended
        self._pidfds: dict[int, int] = {}  # by rank, where pidfds exist: the pidfd in ``ends``
        self.ready: set[int] = set()  # the ranks that said they are set up (their first message)
        self.start_timeout = config.rdzv_timeout  # seconds the ranks may take to be set up
        self._stack = contextlib.ExitStack()
        self.closed = False
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
            stacks=True,  # a submitted call's future.stacks(): installed once, for every call
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
        self.conns = [ours for ours, _ in pipes]
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
            pidfd = open_pidfd(process)
        except (AttributeError, OSError):
            self.ends.append(process.sentinel)
        else:
            self.ends.append(pidfd)
            self._pidfds[len(self.processes) - 1] = pidfd

    def stacks(self) -> dict[int, str]:
        """Every live rank's Python stacks (all threads), by rank, within ``DUMP_BOUND`` seconds; the ranks
        keep running. Empty once the workers are closed, and in a process forked from their owner."""
        if self.closed or os.getpid() != self.pid or STACKS_SIGNAL is None:
            return {}
        signum = STACKS_SIGNAL
        senders = {
            rank: functools.partial(send_signal, process.pid, self._pidfds.get(rank), signum)
            for rank, process in enumerate(self.processes)
            if process.pid is not None
        }
        return stacks.collect(self.spec.directory, senders)

    def ended(self, rank: int) -> bool:
        """Whether ``rank``'s worker has ended, also when someone else reaped it (a caller's SIGCHLD handler
        that reaps every child): its pidfd says so, and gives its exit status where the kernel keeps it
        (Linux 6.15+), which is then the process's ``exitcode``."""
        process = self.processes[rank]
        if process.exitcode is not None:
            return True
        pidfd = self._pidfds.get(rank)
        if pidfd is None or not readable([pidfd], 0):
            return False
        with signals_held():  # multiprocessing's reaping: a Ctrl-C between its waitpid and its note loses it
            process.join(0)
        popen = getattr(process, "_popen", None)
        if process.exitcode is None and popen is not None and (status := reaped_status(pidfd)) is not None:
            popen.returncode = os.waitstatus_to_exitcode(status)  # someone else reaped it
        return True

    def alive(self) -> bool:
        """Whether every worker still runs (none died or was stopped between calls)."""
        return (
            not self.broken
            and not self.closed
            and not any(self.ended(rank) for rank in range(len(self.processes)))
            and all(p.is_alive() for p in self.processes)
        )

    def terminate(self) -> None:
        """Stop every worker: SIGTERM, then SIGKILL with everything it started after ``grace_period`` seconds;
        reap."""
        self.broken = True
        if self.closed or os.getpid() != self.pid:
            return
        alive = [rank for rank in range(len(self.processes)) if not self.ended(rank)]
        for rank in alive:
            signal_worker(self.processes[rank], signal.SIGTERM)
        self._reap(alive)

    def _reap(self, alive: list[int]) -> None:
        """Wait up to ``grace_period`` seconds for the ranks ``alive`` to end, then kill what is left with its
        tree; reap all. A worker that someone else reaped is never signalled (its pid may be another's)."""
        deadline = time.monotonic() + self.spec.grace_period
        try:
            while (running := [rank for rank in alive if not self.ended(rank)]) and time.monotonic() < deadline:
                readable([self.ends[rank] for rank in running], max(0.0, deadline - time.monotonic()))
        finally:
            for rank, process in enumerate(self.processes):
                if not self.ended(rank):  # (ended() reaped the others, or someone else did)
                    kill_tree(process)
                    process.join()

    def close(self) -> None:
        """Tell the workers to leave, wait ``grace_period`` seconds for them, stop those still running, and
        remove everything: pipes, pidfds, the store, the output pump, the launch directory. Idempotent. In a
        process forked from the owner (its exit handlers, its garbage collector) only the copy is marked
        closed: the ranks, their pipes and directory are the owner's."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.pid:  # a forked child's copy (its exit, its garbage collector): the owner's ranks
            return
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send((EXIT,))
            self._reap([rank for rank in range(len(self.processes)) if not self.ended(rank)])
        finally:
            for conn in self.conns:
                conn.close()
            for fd in self.ends:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for process in self.processes:
                release(process)
            self._stack.close()


class Held:
    """What a :class:`~mplaunch.Workers` owns, apart from it: its team, and the lock of its calls."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process whose ranks these are: a process forked from it has copies only
        self.team: Team | None = None
        self.closed = False
        self.lock = threading.Lock()  # one call at a time
        self.owner: threading.Thread | None = None  # the thread whose call holds the lock
        # that call's stream, if it is one; weak: a stream dropped after a `break` is freed at once, which closes it
        self.stream: weakref.ref[Stream[Any]] | None = None
        _open.add(self)
        _register_exit()

    def close(self) -> None:
        """Close the team, for good. Idempotent."""
        self.closed = True
        team, self.team = self.team, None
        if team is not None:
            team.close()  # in a process forked from the owner, a copy: it leaves the owner's ranks alone

    def check_process(self) -> None:
        """Raise ``RuntimeError`` in a process forked from the one that made these workers."""
        forks.check_owner(self.pid, "these mplaunch.Workers", "Make new Workers in this process.")


class Busy:
    """The call lock of one :class:`Held`, noting the thread that holds it."""

    def __init__(self, held: Held) -> None:
        self._held = held

    def __enter__(self) -> None:
        self._held.lock.acquire()
        self._held.owner = threading.current_thread()

    def __exit__(self, *exc: object) -> None:
        self._held.owner = None
        self._held.stream = None
        self._held.lock.release()


_open: weakref.WeakSet[Held] = weakref.WeakSet()
_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_close_all)  # after multiprocessing's handler, so it runs first (last in, first out)
        _exit_registered = True


def _close_all() -> None:
    """At exit, before ``multiprocessing`` joins its children: close every open set of warm workers."""
    for held in list(_open):
        held.close()
