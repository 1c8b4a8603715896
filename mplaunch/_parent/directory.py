"""The launch directory ``<root>/mplaunch-<pid>-<pid namespace>-<random>`` in shared memory, where a launch's
payload and outcomes live. For a parent that dies abruptly, its first launch starts a *reaper* that removes its
directories when a pipe only the parent holds closes (as CPython's ``multiprocessing.resource_tracker``), and
removes those of dead parents of this pid namespace."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

from mplaunch._errors import LaunchRefusedError
from mplaunch._parent.processes import forget_reaper, start_reaper
from mplaunch._platform import forks

_DIR_PREFIX = "mplaunch-"
_ENSURING = forks.new_lock()  # maybe held by a thread at a fork
_reapers: dict[tuple[int, str], int] = {}  # (pid, root) -> pid of this process's reaper for root


def shm_root() -> str:
    """Return where launch directories go: ``MPLAUNCH_SHM_DIR`` if set, else /dev/shm, else the temp dir."""
    configured = os.environ.get("MPLAUNCH_SHM_DIR")
    if configured:
        return configured
    root = "/dev/shm"
    if os.path.isdir(root) and os.access(root, os.W_OK):
        return root
    return tempfile.gettempdir()


def _pid_namespace() -> str:
    """Return this pid namespace, so that another's directories sharing /dev/shm (--ipc=host) are never judged."""
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def own_prefix() -> str:
    """Return the name prefix of this process's launch directories."""
    return f"{_DIR_PREFIX}{os.getpid()}-{_pid_namespace()}-"


def remove_stale_directories(root: str) -> None:
    """Remove launch directories left by parents of this pid namespace whose pid no longer exists."""
    namespace = _pid_namespace()
    for entry in os.listdir(root):
        if not entry.startswith(_DIR_PREFIX):
            continue
        pid, _, rest = entry[len(_DIR_PREFIX) :].partition("-")
        if pid.isdigit() and rest.startswith(f"{namespace}-") and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def reaper_pids() -> list[int]:
    """Return the pids of this process's reapers (one per root), for leak checks in tests."""
    return [reaper for (pid, _), reaper in _reapers.items() if pid == os.getpid()]


def _ensure_reaper(root: str) -> None:
    """Start this process's reaper for ``root`` unless it runs; one at a time, or concurrent launches start one each."""
    with _ENSURING:
        _start_reaper(root)


def _start_reaper(root: str) -> None:
    key = (os.getpid(), root)
    if key in _reapers:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(_reapers[key], os.WNOHANG) == (0, 0):
                return  # still running
        forget_reaper(_reapers.pop(key))
    remove_stale_directories(root)
    started = start_reaper(root, own_prefix())
    if started is not None:  # else directories of a killed parent are removed by a later launch
        _reapers[key] = started


@contextlib.contextmanager
def launch_directory() -> Iterator[str]:
    """Create this launch's directory, yield its path, and remove it after, in this process only (not a child's)."""
    while (fd := os.open(os.devnull, os.O_RDWR)) <= 2:  # a closed fd 0-2 (a daemon's) gets /dev/null: a descriptor
        pass  # the launch made there would be a spawned rank's stdin, stdout or stderr, replaced as it starts
    os.close(fd)
    root = shm_root()
    maker = os.getpid()
    try:
        directory = tempfile.mkdtemp(prefix=own_prefix(), dir=root)
    except OSError as error:
        configured = os.environ.get("MPLAUNCH_SHM_DIR")
        where = f"MPLAUNCH_SHM_DIR={configured!r}" if configured else repr(root)
        raise LaunchRefusedError(
            f"cannot make the launch's directory in {where}: {error}. "
            + (
                "Set MPLAUNCH_SHM_DIR to a directory this process can write to, or unset it."
                if configured
                else "Make room there or set MPLAUNCH_SHM_DIR to a directory this process can write to."
            )
        ) from error
    try:
        _ensure_reaper(root)
        yield directory
    finally:
        if os.getpid() == maker:
            _remove(directory)


def _remove(directory: str) -> None:
    """Remove a launch directory, with no descriptor where it is empty (at the open-files limit)."""
    try:
        os.rmdir(directory)
        return
    except OSError:
        pass
    try:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)


def space_hint(directory: str) -> str:
    """Say how much room ``directory``'s file system has, and how to get more."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return ""
    free, total = stats.f_bavail * stats.f_frsize / 2**20, stats.f_blocks * stats.f_frsize / 2**20
    return (
        f"It has {free:.0f} MiB free of {total:.0f} MiB; mplaunch needs room there for the arguments and results "
        "(e.g. docker run --shm-size=8g), or set MPLAUNCH_SHM_DIR to a larger directory."
    )


@contextlib.contextmanager
def log_dir_held(log_dir: str | None) -> Iterator[None]:
    """Hold ``log_dir`` while a launch writes there: an exclusive ``flock``, any process's (a fork closes its copy)."""
    if log_dir is None:
        yield
        return
    fd = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LaunchRefusedError(
            f"log_dir={log_dir!r} is used by another launch that still runs (here or in another process): their "
            "rank{N}.log, stacks and traces would mix. Give each launch at a time its own log_dir, e.g. "
            "fn.options(log_dir=f'logs/{trial}').submit(...)."
        ) from None
    _log_dirs.add(fd)
    try:
        yield
    finally:
        _log_dirs.discard(fd)
        os.close(fd)


_log_dirs: set[int] = set()  # the descriptors of the log_dirs held


@forks.in_child
def _let_go_of_log_dirs() -> None:
    while _log_dirs:
        os.close(_log_dirs.pop())
