"""The only code that starts processes: a launch's workers (forked here where pidfds exist, else through
``torch.multiprocessing``), the fork server, the launch-directory reaper. Signalling and killing them is
:mod:`mplaunch._parent.signalling`.

While workers start, the parent holds: a ``__main__`` that multiprocessing can describe to a spawned child,
one string-hashing seed for spawned workers, the signals of ``signals.HELD``, and a lock against concurrent
starts."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_fork
import multiprocessing.process
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
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker.entry import run

#: Held while a launch starts its workers: one launch forks at a time. Where multiprocessing starts them, it
#: makes a worker's sentinel pipe, forks, then closes the pipe's write end here: a fork from another thread
#: (a concurrent ``submit()``) in between would give that end to the other launch's worker, and this launch
#: would never see its own worker end. A forked child gets the lock as its parent held it, so it is made new
#: there (CPython's own re-initialisation, as logging's).
_STARTING = forks.new_lock()


@forks.in_child
def _forget_fork_server() -> None:
    """In a child forked from this process (a fork-launched rank, a ``multiprocessing.Pool`` worker): the fork
    server this process started is not the child's own (``ensure_running`` would fail in ``waitpid`` with a
    bare ``ChildProcessError``), so the child starts one of its own when it launches with ``forkserver``."""
    server: Any = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    if alive is not None:
        with contextlib.suppress(OSError):  # the parent's server ends when the parent lets it go, not this child
            os.close(alive)


def start_workers(
    specs: Sequence[WorkerSpec],
    payload: Payload | None,
    preload: list[str],
    started: Callable[[BaseProcess], None],
    *,
    target: Callable[..., None] = run,
    rank_args: Sequence[tuple[Any, ...]] = (),
) -> None:
    """Start one worker per spec of ``specs``, rank 0 first, each running ``target`` (a launch's
    :func:`mplaunch._worker.entry.run`); hand each to ``started`` as soon as it runs (the engine opens its
    pidfd before anything can reap it).

    Args:
        specs: each rank's worker spec (the launch's start method, nprocs, ...).
        payload: the call, for forked workers to inherit; ``None`` where workers read it from the launch
            directory.
        preload: modules the fork server imports once, when this launch starts it.
        started: called with each started process, in rank order.
        target: what each worker runs, called as ``target(rank, specs[rank], payload, *rank_args[rank])``.
        rank_args: per rank, more arguments for ``target`` (e.g. a warm worker's end of its pipe);
            empty: none.
    """
    spec = specs[0].launch
    context = mp.get_context(spec.start_method)
    rank = 0
    try:
        if spec.start_method == "spawn" or (spec.start_method == "forkserver" and not _forkserver_running()):
            check_exec_environment(os.environ, spec.start_method)  # else the worker "exits with code 255"
        with main_prepared():
            if spec.start_method == "forkserver":
                context.set_forkserver_preload(preload)
                short_socket_directory()
                multiprocessing.forkserver.ensure_running()  # before signals are blocked: it must not inherit that
            kind = _ForkProcess if spec.start_method == "fork" else context.Process  # type: ignore[attr-defined]
            processes = [
                kind(
                    target=target,
                    args=(rank, specs[rank], payload, *(rank_args[rank] if rank_args else ())),
                    name=f"mplaunch-rank{rank}",
                    daemon=False,
                )
                for rank in range(spec.nprocs)
            ]
            with _STARTING, MAKING, signals_held(), spawn_hash_seed(spec.start_method), daemonic_allowed():
                if spec.start_method == "fork" and _pidfds_work():
                    rank, failure = _fork_all(processes, started)
                    if failure is not None:
                        raise failure  # (rank: the first that did not start, for the message)
                    return
                for rank, process in enumerate(processes):  # noqa: B007 - the rank that failed is reported
                    process.start()
                    # the launch reaps it, as it does forked ones: multiprocessing's list of children is where
                    # another thread's start or active_children() reaps ended children, exit code and usage
                    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
                    started(process)
    except (OSError, EOFError) as error:
        if spec.start_method == "forkserver":
            _forget_dead_forkserver()
        refused = start_refused(error, spec.start_method, rank, spec.nprocs)
        if refused is None:
            raise
        traceback.clear_frames(error.__traceback__)  # multiprocessing's half-made Popen: its finalizer closes its pipes
        raise refused from error


def _fork_all(processes: list[BaseProcess], started: Callable[[BaseProcess], None]) -> tuple[int, OSError | None]:
    """Fork every one of ``processes``, one right after the other, then hand each to ``started``. Returns
    ``(len(processes), None)``, else the rank that could not start and why: a fork refused, or a pidfd that
    could not be opened (that worker is killed and reaped); the workers forked before it are handed over.

    Each worker is forked as ``multiprocessing`` would (the child runs the process's ``_bootstrap``, so it is
    ``current_process()`` there), without what it adds for a child that nobody else waits on: two pipes, a
    finalizer, and a poll of every earlier child, per start. Each worker's pidfd is opened right after its
    fork, before it can end (and be reaped by someone else: a caller's SIGCHLD handler); the rest of the
    parent's bookkeeping comes after the last fork: after each fork, each page the parent writes is copied,
    so bookkeeping between forks copied the same pages once per worker. Each worker sees its parent through
    a pidfd too (``parent_process()``). The workers are not ``multiprocessing``'s children: starting another
    process (a fork from another thread) never reaps them before the launch does."""
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
    """``multiprocessing``'s handle of a child that :func:`_fork_all` forked (poll, wait, terminate, kill); its
    ``sentinel`` is a pidfd, closed with it."""

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
    """A new pidfd of the started ``process``, for the caller to close: a copy of the one :func:`_fork_all`
    opened right after its fork (before anything could reap it: a worker that ends at once may be reaped by a
    caller's SIGCHLD handler before the launch's bookkeeping), else ``os.pidfd_open`` of its pid.

    Raises:
        OSError: no pidfds here (Linux before 5.3), or the process is gone.
        AttributeError: ``os.pidfd_open`` does not exist here.
    """
    popen = getattr(process, "_popen", None)
    if isinstance(popen, _Forked) and popen.sentinel >= 0:
        return os.dup(popen.sentinel)
    return os.pidfd_open(process.pid)  # type: ignore[arg-type]


def started_at(process: BaseProcess) -> float:
    """When ``process`` started (``time.monotonic()``): right after its fork where :func:`_fork_all` forked
    it (the launch's bookkeeping comes after the last fork), else now."""
    popen = getattr(process, "_popen", None)
    return popen.started_at if isinstance(popen, _Forked) else time.monotonic()


def release(process: BaseProcess) -> None:
    """Close ``process``'s descriptors once the launch is done with it: ``Process.close()``, and where
    ``multiprocessing`` still takes it for running (someone else reaped it: a caller's SIGCHLD handler, or a
    Ctrl-C landed between its reaping and the noting of its exit code), its pidfd."""
    try:
        process.close()
    except ValueError:
        popen = getattr(process, "_popen", None)
        if isinstance(popen, _Forked):
            popen.close()


@functools.lru_cache(maxsize=1)
def _pidfds_work() -> bool:
    """Whether this kernel gives pidfds (Linux 5.3+), which :func:`_fork_all` needs."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


class _ForkPopen(multiprocessing.popen_fork.Popen):
    """CPython's ``popen_fork.Popen`` (3.11), which closes its pipes when ``fork`` or the second pipe fails;
    CPython's leaves them open (two or four descriptors each time the process limit or the open-files limit
    is hit)."""

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
    """A fork-started process using :class:`_ForkPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _ForkPopen(process_obj)


def _forkserver_running() -> bool:
    """Whether multiprocessing's fork server runs (a new one is started with ``exec``)."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid is not None and _alive(pid)


def _alive(pid: int) -> bool:
    """Whether child ``pid`` has not ended (it is left unreaped)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _forget_dead_forkserver() -> None:
    """Reap a fork server that died (of a limit, while forking a worker) and let the next launch start a new
    one; multiprocessing would leave it a zombie until then."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None and not _alive(pid):
        with contextlib.suppress(OSError, AttributeError):
            server._stop()  # type: ignore[attr-defined] # closes its "alive" pipe, reaps it, removes its socket


@contextlib.contextmanager
def daemonic_allowed() -> Iterator[None]:
    """Let a daemonic process (a ``multiprocessing.Pool`` worker, where hyper-parameter searches run their
    trials) start workers: ``Process.start()`` refuses children there (``AssertionError: daemonic processes
    are not allowed to have children``), because a daemonic process is terminated without running its exit
    code, which would leave its children running. A worker never outlives the process that launched it
    (``PR_SET_PDEATHSIG`` under fork and spawn, a pidfd watch under forkserver), nor does the launch
    directory (the reaper), so the flag is lifted while the workers start; the workers themselves are not
    daemonic."""
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
    """Hide a ``__main__.__file__`` that is no real file (``python -`` sets ``<stdin>``): multiprocessing's
    spawn would try to run it in the child and fail before our code runs. A ``__main__`` without
    ``__spec__`` (``python -m pdb`` clears its namespace for the script) gets ``None``, as a script has:
    multiprocessing reads it."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    path = getattr(main, "__file__", None)
    hide = path is not None and not os.path.isfile(path)
    add_spec = "__spec__" not in vars(main)
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


@functools.lru_cache(maxsize=1)
def _hash_seed() -> str:
    """This process's seed for the string hashing of its spawn workers, drawn once."""
    return str(int.from_bytes(os.urandom(4), "little") or 1)


@contextlib.contextmanager
def spawn_hash_seed(start_method: str) -> Iterator[None]:
    """Give spawn workers one ``PYTHONHASHSEED`` (unless the user set one), so that every rank hashes strings
    alike, as forked ranks (the parent's hashing) and forkserver ranks (the server's) do.

    The seed must be in the environment a spawned interpreter starts with, and multiprocessing execs it with
    this process's environment: it is set only while the workers start, with SIGINT and SIGTERM blocked (so
    no handler of ours runs in between), and removed at once. The same seed serves every launch of this
    process, so ranks of successive launches agree too.
    """
    if start_method != "spawn" or os.environ.get("PYTHONHASHSEED") not in (None, "", "random"):
        yield
        return
    with environ_kept():
        os.environ["PYTHONHASHSEED"] = _hash_seed()
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
    """Start the reaper of this process's launch directories in ``root`` (named ``prefix...``): a tiny Python
    (no site, no torch) in a session of its own, holding the read end of a pipe whose write end only this
    process keeps; when the pipe closes (this process died, however), it removes the directories.

    Returns:
        The reaper's pid, or ``None`` when it could not be started.
    """
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


#: The write end of each running reaper's pipe, by the reaper's pid. The pipe must close when this process
#: dies, so a forked child (a worker, the user's) closes them all first thing: exactly the ends open now,
#: never a descriptor number that a closed pipe once had and a new file reuses.
_reaper_pipes: dict[int, int] = {}


@forks.in_child
def _close_reaper_pipes() -> None:
    for fd in _reaper_pipes.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _reaper_pipes.clear()
