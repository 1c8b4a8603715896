"""Watching the workers of one launch: reading their outcomes, stopping them, raising the first failure."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from mplaunch import _transport
from mplaunch._config import LaunchConfig
from mplaunch._control import LaunchControl, LaunchStopped
from mplaunch._errors import (
    LaunchTimeoutError,
    RemoteError,
    RemoteTraceback,
    WorkerExitedError,
    WorkerFailedError,
)
from mplaunch._worker import WorkerSpec, outcome_name


class Supervisor:
    """Waits for the workers of one launch, reads their outcomes, and stops them all."""

    def __init__(
        self, spec: WorkerSpec, processes: list[BaseProcess], config: LaunchConfig, control: LaunchControl | None = None
    ) -> None:
        self.spec = spec
        self.processes = processes
        self.config = config
        self.control = control or LaunchControl()
        self.values: dict[int, Any] = {}
        self.stopped: set[int] = set()
        self.collected: set[int] = set()

    def wait(self) -> list[Any]:
        self.control.start_clock(self.config.timeout)  # one deadline for every attempt of the launch
        stop = self.control.fileno()
        pending: dict[Any, int] = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        while pending:
            ready = wait([*pending, *([] if stop is None else [stop])], timeout=self.control.remaining())
            if not ready:
                self._raise_timeout(sorted(pending.values()))
            if stop in ready:
                raise LaunchStopped()  # the caller's clean-up stops the workers
            for sentinel in ready:
                rank = pending.pop(sentinel)
                failure = self._collect(rank)
                if failure is not None:
                    self._raise_failure(failure, rank)
        return [self.values.get(rank) for rank in range(self.spec.nprocs)]

    def _collect(self, rank: int) -> BaseException | None:
        """Read the outcome of a finished worker: store its value, or return its failure."""
        process = self.processes[rank]
        process.join()
        self.collected.add(rank)
        name = outcome_name(rank)
        if not _transport.exists(self.spec.directory, name):
            return self._exit_error(rank, process)
        try:
            outcome = _transport.load(self.spec.directory, name, private=False, remove=True)
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
        if outcome["ok"]:
            if rank in self.spec.reporting_ranks:
                self.values[rank] = outcome["value"]
            return None
        return rebuild_exception(outcome, rank)

    def _exit_error(self, rank: int, process: BaseProcess) -> WorkerExitedError:
        code = process.exitcode
        error = WorkerExitedError("", rank, process.pid, code)
        if error.signal_name is not None:
            what = f"was killed by {error.signal_name} (exit code {code})"
            if error.signal_name == "SIGKILL":
                what += "; the out-of-memory killer is a likely cause (see `dmesg`), or a `kill -9`"
        elif code == 0:
            what = "exited with code 0 before returning (os._exit() or sys.exit() from another thread?)"
        else:
            what = f"exited with code {code} before returning"
        error.args = (f"rank {rank} (pid {process.pid}) {what}",)
        return error

    def _raise_failure(self, failure: BaseException, rank: int) -> None:
        """Stop the others, keep their own failures (not the stop we caused) on ``failure``, raise it."""
        self.stop()
        others = []
        for other in range(self.spec.nprocs):
            if other == rank or other in self.values or other in self.collected:
                continue
            other_failure = self._collect(other)
            if other_failure is None or (other in self.stopped and _caused_by_stop(other_failure)):
                continue
            others.append(other_failure)
        _set_attribute(failure, "failures", tuple(others))
        self.control.failure = failure
        raise failure from failure.__cause__

    def _raise_timeout(self, running: list[int]) -> None:
        self.stop()
        timeout = self.config.timeout or 0.0
        raise LaunchTimeoutError(
            f"the launch did not finish within timeout={timeout:g} s; ranks {running} were still running and "
            "have been stopped. Raise `timeout`, or look for a rank stuck in a collective.",
            timeout,
            tuple(running),
        )

    def stop(self) -> None:
        """SIGTERM every live worker and what it started (its process group), SIGKILL what is still alive after
        ``grace_period`` seconds, reap all; then SIGKILL whatever the finished workers left running."""
        alive = [(rank, p) for rank, p in enumerate(self.processes) if p.exitcode is None]
        try:
            for rank, process in alive:
                self.stopped.add(rank)
                _signal(process, signal.SIGTERM)
            deadline = time.monotonic() + self.config.grace_period
            remaining = [p for _, p in alive]
            while remaining and time.monotonic() < deadline:
                wait([p.sentinel for p in remaining], timeout=max(0.0, deadline - time.monotonic()))
                remaining = [p for p in remaining if p.exitcode is None]
        finally:
            for _, process in alive:
                if process.exitcode is None:
                    _signal(process, signal.SIGKILL)
            for process in self.processes:
                process.join()
                _signal(process, signal.SIGKILL, group_only=True)  # grandchildren left behind


def _caused_by_stop(failure: BaseException) -> bool:
    """Whether a stopped worker's failure is just the SIGTERM/SIGKILL with which the launch stopped it."""
    if isinstance(failure, WorkerExitedError):
        return failure.signal_name in ("SIGTERM", "SIGKILL") or "Terminated(" in str(failure)
    return False


def _signal(process: BaseProcess, signum: int, *, group_only: bool = False) -> None:
    """Signal a worker's process group (it made one of its own at start), or the worker alone if it has
    not made it yet."""
    if process.pid is None:
        return
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        if not group_only:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)


def _set_attribute(error: BaseException, name: str, value: Any) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, name, value)


def rebuild_exception(outcome: dict[str, Any], rank: int) -> BaseException:
    """The worker's exception as itself (or a :class:`RemoteError`), the remote traceback as its cause."""
    pid = outcome["pid"]
    error: BaseException | None = None
    if outcome["exception"] is not None:
        try:
            error = pickle.loads(outcome["exception"])
        except Exception:  # noqa: BLE001
            error = None
    if error is not None and not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: not for the parent
        error = WorkerExitedError(
            f"rank {rank} (pid {pid}) raised {outcome['repr']} before returning, so it has no result",
            rank,
            pid,
            getattr(error, "code", 1) if isinstance(getattr(error, "code", 1), int) else 1,
        )
    if error is None:
        error = RemoteError(
            f"rank {rank} (pid {pid}) raised {outcome['type_name']}: {outcome['message']} (the exception could "
            "not be sent as itself because it cannot be pickled or unpickled)",
            rank,
            pid,
            outcome["type_name"],
        )
    header = f"rank {rank} (pid {pid})"
    error.__cause__ = RemoteTraceback(f'\n"""\n{header} raised:\n{outcome["traceback"]}"""')
    _set_attribute(error, "rank", rank)
    _set_attribute(error, "pid", pid)
    if hasattr(error, "add_note") and not isinstance(error, WorkerFailedError):
        error.add_note(f"(raised in mplaunch worker {header})")
    return error
