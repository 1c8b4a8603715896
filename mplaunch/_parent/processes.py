"""The only code that starts processes: a launch's workers (forked here where pidfds exist, else through
``torch.multiprocessing``), the fork server, the launch-directory reaper. While workers start, the parent holds
a ``__main__`` spawn can describe, a spawn rank's variables, the signals of ``HELD``, and a lock."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_fork
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing as mp

from mplaunch._output.rank_streams import hold_stdin
from mplaunch._parent.limits import check_exec_environment, short_socket_directory, start_refused
from mplaunch._parent.parent_signals import signals_held
from mplaunch._platform import forks
from mplaunch._platform.environ import environ_kept
from mplaunch._wire.inherited import MAKING
from mplaunch._wire.records import Payload
from mplaunch._wire.spec import LaunchSpec, WorkerSpec
from mplaunch._worker.apply_placement import environment
from mplaunch._worker.entry import run

#: Held while a launch starts its workers: a fork from another thread would inherit the write end of a sentinel
#: pipe multiprocessing has yet to close, and this launch would never see its worker end. A child gets it new.
_STARTING = forks.new_lock()


@forks.in_child
def _forget_fork_server() -> None:
    """Forget the parent's fork server in a forked child: its ``waitpid`` would fail there (``ChildProcessError``)."""
    server: Any = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    if alive is not None:
        _close_quietly(alive)  # the parent's server ends when the parent lets it go, not this child


def start_workers(
    specs: Sequence[WorkerSpec],
    payload: Payload | None,
    preload: list[str],
    started: Callable[[BaseProcess], None],
    *,
    target: Callable[..., None] = run,
    rank_args: Sequence[tuple[Any, ...]] = (),
) -> None:
    """Start one worker per spec, rank 0 first, running ``target``; hand each to ``started`` before it can be reaped."""
    spec = specs[0].launch
    method = _exec_method(spec)
    context = mp.get_context(method)
    rank = 0
    try:
        if method == "spawn" or (method == "forkserver" and not _forkserver_running()):
            check_exec_environment(os.environ, method)  # else the worker "exits with code 255"
        with main_prepared():
            if method == "forkserver":
                context.set_forkserver_preload(preload)
                short_socket_directory()
                multiprocessing.forkserver.ensure_running()  # before signals are blocked: it must not inherit that
            if method != "fork":  # before signals are blocked: its start unblocks SIGINT and SIGTERM
                multiprocessing.resource_tracker.ensure_running()  # (bpo-33613), which ranks would then not hold
            kind = _ForkProcess if method == "fork" else context.Process  # type: ignore[attr-defined]
            processes = [
                kind(
                    target=target,
                    args=(rank, specs[rank], payload, *(rank_args[rank] if rank_args else ())),
                    name=f"mplaunch-rank{rank}",
                    daemon=False,
                )
                for rank in range(spec.nprocs)
            ]
            with _STARTING, MAKING, signals_held(), daemonic_allowed():
                if method == "fork" and _pidfds_work():
                    rank, failure = _fork_all(processes, started)
                    if failure is not None:
                        raise failure  # (rank: the first that did not start, for the message)
                    return
                for rank, process in enumerate(processes):  # noqa: B007 - the rank that failed is reported
                    with spawn_environ(method, environment(specs[rank], rank)):
                        process.start()
                    # the launch reaps it, not another thread's start or active_children() (they reap this list)
                    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
                    started(process)
    except (OSError, EOFError) as error:
        if method == "forkserver":
            _forget_dead_forkserver()
        refused = start_refused(error, method, rank, spec.nprocs)
        if refused is None:
            raise
        traceback.clear_frames(error.__traceback__)  # multiprocessing's half-made Popen: its finalizer closes its pipes
        raise refused from error


def _fork_all(processes: list[BaseProcess], started: Callable[[BaseProcess], None]) -> tuple[int, OSError | None]:
    """Fork each process, a pidfd right after each (before a SIGCHLD handler can reap it), the rest after the last
    fork (each page written between forks is copied per worker); return how many started and the error, if any."""
    multiprocessing.util._flush_std_streams()  # type: ignore[attr-defined] # once: nothing is written between
    parent = os.pidfd_open(os.getpid())
    forked: list[BaseProcess] = []
    failed: OSError | None = None
    try:
        for process in processes:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    hold_stdin()  # the worker replaces it, and multiprocessing need not
                    code = process._bootstrap(parent_sentinel=parent)  # type: ignore[attr-defined]
                finally:
                    os._exit(code)
            try:
                process._popen = _Forked(pid)  # type: ignore[attr-defined]
            except OSError:  # no descriptor left for its pidfd: it must not outlive the refusal
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
            forked.append(process)
    except OSError as error:  # the process limit, memory, the open-files limit
        failed = error
    finally:
        os.close(parent)  # each worker has its own copy
    for process in forked:
        process._sentinel = process._popen.sentinel  # type: ignore[attr-defined]
        del process._target, process._args, process._kwargs  # type: ignore[attr-defined] # as start() does
        started(process)
    return len(forked), failed


class _Forked(multiprocessing.popen_fork.Popen):
    """Multiprocessing's handle of a child :func:`_fork_all` forked; its ``sentinel`` is a pidfd."""

    def __init__(self, pid: int) -> None:  # (not super().__init__: that forks)
        self.started_at = time.monotonic()  # right after the fork: the start of the worker's wall time
        self.pid = pid
        self.returncode = None
        self.finalizer = None
        self.sentinel = -1  # (for close(), should the pidfd not open)
        self.sentinel = os.pidfd_open(pid)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def __del__(self) -> None:  # a worker reaped by someone else (a SIGCHLD handler) stays "running"
        self.close()


def open_pidfd(process: BaseProcess) -> int:
    """Return a new pidfd of ``process``: a copy of :func:`_fork_all`'s, else ``os.pidfd_open``'s (which may raise)."""
    popen = getattr(process, "_popen", None)
    if isinstance(popen, _Forked) and popen.sentinel >= 0:
        return os.dup(popen.sentinel)
    return os.pidfd_open(process.pid)  # type: ignore[arg-type]


def started_at(process: BaseProcess) -> float:
    """Return when ``process`` started (``time.monotonic()``): right after its fork in :func:`_fork_all`, else now."""
    popen = getattr(process, "_popen", None)
    return popen.started_at if isinstance(popen, _Forked) else time.monotonic()


def release(process: BaseProcess) -> None:
    """Close ``process``'s descriptors; its pidfd too where multiprocessing still takes it for running (reaped
    by a caller's SIGCHLD handler, or a Ctrl-C between its reaping and the noting of its exit code)."""
    try:
        process.close()
    except ValueError:
        popen = getattr(process, "_popen", None)
        if isinstance(popen, _Forked):
            popen.close()


@functools.lru_cache(maxsize=1)
def _pidfds_work() -> bool:
    """Tell whether this kernel gives pidfds (Linux 5.3+)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


class _ForkPopen(multiprocessing.popen_fork.Popen):
    """CPython 3.11's ``popen_fork.Popen``, but closing its pipes when ``fork`` or the second pipe fails
    (CPython leaks them each time a process or open-files limit is hit)."""

    def _launch(self, process_obj: Any) -> None:
        parent_r, child_w = os.pipe()
        try:
            child_r, parent_w = os.pipe()
        except BaseException:
            _close_quietly(parent_r, child_w)
            raise
        try:
            self.pid = os.fork()
        except BaseException:
            _close_quietly(parent_r, child_w, child_r, parent_w)
            raise
        if self.pid == 0:
            code = 1
            try:
                os.close(parent_r)
                os.close(parent_w)
                code = process_obj._bootstrap(parent_sentinel=child_r)
            finally:
                os._exit(code)
        os.close(child_w)
        os.close(child_r)
        self.finalizer = multiprocessing.util.Finalize(self, _close_quietly, (parent_r, parent_w))
        self.sentinel = parent_r


class _ForkProcess(multiprocessing.context.ForkProcess):
    """Start by fork with :class:`_ForkPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _ForkPopen(process_obj)


def _forkserver_running() -> bool:
    """Tell whether multiprocessing's fork server runs (a new one is started with ``exec``)."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid is not None and _alive(pid)


def _alive(pid: int) -> bool:
    """Tell whether child ``pid`` has not ended, leaving it unreaped."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _forget_dead_forkserver() -> None:
    """Reap a fork server that died (of a limit) so the next launch starts a new one, not a zombie's."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None and not _alive(pid):
        with contextlib.suppress(OSError, AttributeError):
            server._stop()  # type: ignore[attr-defined] # closes its "alive" pipe, reaps it, removes its socket


@contextlib.contextmanager
def daemonic_allowed() -> Iterator[None]:
    """Let a daemonic process (a ``Pool`` worker) start workers: ours never outlive their launcher (PDEATHSIG)."""
    current = multiprocessing.process.current_process()
    config = getattr(current, "_config", None)
    if not isinstance(config, dict) or not config.get("daemon"):
        yield
        return
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = True


@contextlib.contextmanager
def main_prepared() -> Iterator[None]:
    """Make what spawn sends usable by a rank: no ``__main__.__file__`` that is no file (``python -``), a ``__spec__``
    (``python -m pdb``'s ``__main__`` has none), a default start method of the platform's (not joblib loky's)."""
    main: Any = sys.modules.get("__main__")
    default: Any = multiprocessing.context._default_context
    foreign = default._actual_context
    if foreign is not None and foreign._name not in multiprocessing.get_all_start_methods():
        default._actual_context = None  # spawn sends the platform's default instead
    path = getattr(main, "__file__", None)
    hide = path is not None and not os.path.isfile(path)
    add_spec = main is not None and "__spec__" not in vars(main)
    if hide:
        del main.__file__
    if add_spec:
        main.__spec__ = None
    try:
        yield
    finally:
        if hide:
            main.__file__ = path
        if add_spec:
            vars(main).pop("__spec__", None)
        if foreign is not None:
            default._actual_context = foreign


@functools.lru_cache(maxsize=1)
def _hash_seed() -> str:
    """Draw this process's string-hashing seed for its spawn workers, once."""
    return str(int.from_bytes(os.urandom(4), "little") or 1)


def _exec_method(spec: LaunchSpec) -> str:
    """Return how the ranks start: as asked, but with ``env=`` spawn for forkserver (its server has the old environ)."""
    changes = [placement.environ for placement in spec.placements or ()]
    if spec.start_method == "forkserver" and any(os.environ.get(k) != v for env in changes for k, v in env.items()):
        return "spawn"
    return spec.start_method


@contextlib.contextmanager
def spawn_environ(start_method: str, variables: dict[str, str]) -> Iterator[None]:
    """Put a spawn rank's ``variables`` and one ``PYTHONHASHSEED`` for all ranks (unless set) in this process's
    environment while it starts: exec passes them on, so its interpreter and the script's imports see them."""
    if start_method != "spawn":
        yield
        return
    with environ_kept():
        if os.environ.get("PYTHONHASHSEED") in (None, "", "random"):
            os.environ["PYTHONHASHSEED"] = _hash_seed()
        os.environ.update(variables)
        yield


#: The reaper's whole program: wait for the pipe to close (its parent died), then remove the directories.
_REAPER = """
import os, shutil, sys
root, prefix = sys.argv[1], sys.argv[2]
while os.read(0, 4096):
    pass
for entry in os.listdir(root):
    if entry.startswith(prefix):
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
"""


def start_reaper(root: str, prefix: str) -> int | None:
    """Start the remover of ``root/prefix*`` once a pipe only this process holds closes; return its pid or ``None``."""
    read_end, write_end = os.pipe()
    try:
        reaper = os.posix_spawn(
            sys.executable,
            [sys.executable, "-S", "-I", "-c", _REAPER, root, prefix],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, read_end, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,  # a terminal's Ctrl-C to our process group must not end it before us
        )
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    _reaper_pipes[reaper] = write_end
    return reaper


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def forget_reaper(reaper: int) -> None:
    """Close the pipe of a reaper that has ended (it was killed): a new one takes its place."""
    with contextlib.suppress(OSError, KeyError):
        os.close(_reaper_pipes.pop(reaper))


#: The write end of each running reaper's pipe, by the reaper's pid. A forked child closes exactly these (never
#: a reused number), so the pipe closes when this process dies.
_reaper_pipes: dict[int, int] = {}


@forks.in_child
def _close_reaper_pipes() -> None:
    _close_quietly(*_reaper_pipes.values())
    _reaper_pipes.clear()
