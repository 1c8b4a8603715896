"""The launch directory: where a launch's payload and outcomes live, in shared memory, and how it is removed.

Each launch makes ``<root>/mplaunch-<pid>-<pid namespace>-<random>``, where ``<root>`` is
``MPLAUNCH_SHM_DIR``, else ``/dev/shm``, else the temp dir. It is removed when the launch ends, also when a
SIGTERM ends the parent. A parent that dies abruptly (SIGKILL, SIGHUP, SIGQUIT, a crash) cannot remove it, so
the first launch of a process starts a *reaper*: a tiny Python process (no torch) that holds the read end of a
pipe whose write end only this process keeps, and removes this process's launch directories when the pipe
closes, i.e. within moments of the parent's death, however it died. It is the approach of CPython's
``multiprocessing.resource_tracker``, which cannot remove directories. Before starting it, that first launch
also removes the directories of dead parents of this pid namespace that had none (a reaper killed too).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator

_DIR_PREFIX = "mplaunch-"
_REAPER = """
import os, shutil, sys
root, prefix = sys.argv[1], sys.argv[2]
while os.read(0, 4096):
    pass
for entry in os.listdir(root):
    if entry.startswith(prefix):
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
"""
_ENSURING = threading.Lock()


def _new_ensuring_lock() -> None:
    global _ENSURING  # a forked child may get the lock locked by another thread
    _ENSURING = threading.Lock()


os.register_at_fork(after_in_child=_new_ensuring_lock)
_reapers: dict[tuple[int, str], int] = {}  # (pid, root) -> pid of this process's reaper for root


def shm_root() -> str:
    """Where launch directories go: ``MPLAUNCH_SHM_DIR`` if set, else /dev/shm, else the temp dir."""
    configured = os.environ.get("MPLAUNCH_SHM_DIR")
    if configured:
        return configured
    root = "/dev/shm"
    if os.path.isdir(root) and os.access(root, os.W_OK):
        return root
    return tempfile.gettempdir()


def _pid_namespace() -> str:
    """This process's pid namespace, so that directories of another namespace sharing /dev/shm (e.g. a
    container with --ipc=host) are never judged by pids of this one."""
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def own_prefix() -> str:
    """The name prefix of this process's launch directories."""
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
    except PermissionError:
        return True
    return True


def reaper_pids() -> list[int]:
    """Pids of this process's reapers (one per root directory used), for leak checks in tests."""
    return [reaper for (pid, _), reaper in _reapers.items() if pid == os.getpid()]


def _ensure_reaper(root: str) -> None:
    """Start this process's reaper for ``root`` unless it runs (see the module docstring); when starting it,
    remove first what parents that died without one left there. One at a time: concurrent launches
    (``submit()``) would start one each."""
    with _ENSURING:
        _start_reaper(root)


def _start_reaper(root: str) -> None:
    key = (os.getpid(), root)
    if key in _reapers:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(_reapers[key], os.WNOHANG) == (0, 0):
                return  # still running
    remove_stale_directories(root)
    read_end, write_end = os.pipe()
    try:
        reaper = os.posix_spawn(
            sys.executable,
            [sys.executable, "-S", "-I", "-c", _REAPER, root, own_prefix()],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, read_end, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,  # a terminal's Ctrl-C to our process group must not end it before us
        )
    except OSError:  # no reaper: directories of a killed parent are then removed by a later launch
        os.close(write_end)
        return
    finally:
        os.close(read_end)
    _reapers[key] = reaper
    # the pipe must close when this process dies: forked children (workers, the user's) must not hold it
    os.register_at_fork(after_in_child=lambda: _close_quietly(write_end))


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@contextlib.contextmanager
def launch_directory() -> Iterator[str]:
    """Create this launch's directory, yield its path, and remove it (with whatever is left in it) after."""
    root = shm_root()
    _ensure_reaper(root)
    directory = tempfile.mkdtemp(prefix=own_prefix(), dir=root)
    try:
        yield directory
    finally:
        try:
            os.rmdir(directory)  # what a launch wrote, it has read and removed: the directory is empty
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)


def space_hint(directory: str) -> str:
    """Say how much room the shared-memory file system has, and how to get more."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return ""
    free, total = stats.f_bavail * stats.f_frsize / 2**20, stats.f_blocks * stats.f_frsize / 2**20
    return (
        f"It has {free:.0f} MiB free of {total:.0f} MiB; mplaunch needs room there for the arguments and results "
        "(e.g. docker run --shm-size=8g), or set MPLAUNCH_SHM_DIR to a larger directory."
    )
