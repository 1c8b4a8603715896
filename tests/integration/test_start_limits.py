"""Starting workers at the edges: the open-files limit hit at each step, another thread making a memory file
while workers fork, a caller's SIGCHLD handler that reaps every child, an unusable ``MPLAUNCH_SHM_DIR``.
Each case was found by a break-it pass on the fork launch path, and failed before its fix."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mplaunch import LaunchRefusedError, parallel
from tests.helpers import fork_with, kernel_keeps_reaped_status, reaping_sigchld_handler


def _same(value: Any) -> Any:
    return value


def _memory_files() -> int:
    """How many of mplaunch's memory files this rank holds (its own outcome's: one)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:mplaunch-"):
                count += 1
    return count


def _descriptors() -> dict[int, str]:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


# Finding 1 (regression of eb9482d, registry of memory files): a memory file that another thread's launch
# has made (memfd_create returned) but not yet noted in fds._MADE when this launch forks is not closed by the
# forked workers: they hold another launch's outcome (its memory) until they exit; a Workers rank for its
# whole life. The scan of /proc/self/fd closed it. The thread switch right after memfd_create is real:
# os.memfd_create releases the GIL for the system call, and the forking thread may hold it when it returns.
def test_workers_close_a_memory_file_that_another_thread_made_while_they_forked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made, forked = threading.Event(), threading.Event()
    create = os.memfd_create
    other: dict[str, Any] = {}

    def stalled_create(name: str, flags: int = os.MFD_CLOEXEC) -> int:
        fd = create(name, flags)
        if threading.current_thread() is other.get("thread") and not made.is_set():
            made.set()  # the other launch holds a memory file that is not noted yet
            forked.wait(2)  # long enough for this launch to fork meanwhile, were it not held until the note
        return fd

    monkeypatch.setattr(os, "memfd_create", stalled_create)
    count = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True)(_memory_files)
    single = parallel(nprocs=1, start_method="fork", timeout=60)(_same)
    result: dict[str, Any] = {}
    other["thread"] = threading.Thread(target=lambda: result.setdefault("value", single("other")))
    other["thread"].start()
    try:
        assert made.wait(60)
        seen = count()
    finally:
        forked.set()
        other["thread"].join(60)
    assert result == {"value": "other"}
    assert seen == [1, 1], "a forked worker kept another launch's memory file"


@contextlib.contextmanager
def _free_descriptors(free: int) -> Iterator[None]:
    """Leave exactly ``free`` descriptor numbers under the open-files limit for the block."""
    top = max(_descriptors())
    fillers = []
    while (fd := os.open(os.devnull, os.O_RDONLY)) <= top:
        fillers.append(fd)
    os.close(fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)


# Finding 2: at the open-files limit, the direct fork path starts both workers (it needs fewer descriptors
# than Process.start()), then the parent cannot map rank 0's outcome (mmap dups the descriptor: EMFILE) and
# reports "RemoteError: rank 0 (pid N) returned a result that cannot be unpickled in the parent: OSError:
# [Errno 24] Too many open files": the user's result is blamed for the parent's limit. Before 1e74267 the
# same limits refused the launch ("could not start rank 1 of 2 ... open-files limit").
@pytest.mark.slow
def test_the_open_files_limit_is_never_blamed_on_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    # output not routed (pytest's capture would route it): the pump's pipes would shift the window
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    same = parallel(nprocs=2, start_method="fork", timeout=60)(_same)
    same(0)  # the reaper and the imports are in place
    for free in range(1, 24):  # 0: finding 3
        before = _descriptors()
        message = ""
        with _free_descriptors(free):
            try:
                same(free)
            except Exception as error:  # noqa: BLE001 - every kind is checked below
                message = f"{type(error).__name__}: {error}"
        assert "cannot be unpickled" not in message, f"{free} free descriptors: {message}"
        for fd in set(_descriptors()) - set(before):  # finding 6's pipes: kept out of this sweep
            os.close(fd)


# Finding 3 (also before this session): with no descriptor free, the launch directory is made (mkdir needs
# none), the launch is refused, and the directory is left in /dev/shm: directory._remove lists it first
# (os.listdir needs a descriptor), and shutil.rmtree fails the same way, silently. An empty directory can be
# removed with os.rmdir alone.
def test_a_launch_refused_at_the_open_files_limit_removes_its_directory() -> None:
    same = parallel(nprocs=2, start_method="fork", timeout=60)(_same)
    same(0)
    with _free_descriptors(0), pytest.raises(LaunchRefusedError, match="open-files limit"):
        same(1)
    left = [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{os.getpid()}-")]
    assert not left, f"launch directory left: {left}"


# Finding 4 (also before this session): MPLAUNCH_SHM_DIR naming a directory that cannot hold a launch
# directory (missing, a file, no write permission) ends the call with a bare FileNotFoundError /
# NotADirectoryError / PermissionError from tempfile.mkdtemp, which names neither MPLAUNCH_SHM_DIR nor a fix.
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_an_unusable_shm_dir_is_refused_naming_the_variable(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "shm"
    if kind == "file":
        target.write_text("")
    monkeypatch.setenv("MPLAUNCH_SHM_DIR", str(target))
    with pytest.raises(LaunchRefusedError, match="MPLAUNCH_SHM_DIR"):
        parallel(nprocs=2, start_method="fork", timeout=60)(_same)(1)


# Finding 5 (also before this session, fewer descriptors now): a caller's SIGCHLD handler that reaps every
# child (a common server pattern) reaps the workers first; the launch returns, but each worker's _Forked
# pidfd stays open forever (poll() sees ECHILD and answers "running", close() raises ValueError, which
# launch.py suppresses, and _Forked has no finalizer): two descriptors per launch of two ranks. Before this
# session multiprocessing's sentinel pipes leaked the same way (four per launch), the Process objects
# kept in multiprocessing's _children.
def test_workers_reaped_by_the_callers_sigchld_handler_leave_no_descriptor() -> None:
    same = parallel(nprocs=2, start_method="fork", timeout=60)(_same)
    same(0)
    before = _descriptors()
    with reaping_sigchld_handler():
        assert same(1) == 1
    left = {fd: target for fd, target in _descriptors().items() if fd not in before}
    assert not left, f"descriptors left: {left}"


# Finding 6 (also before this session, _output/pump.py): with routed output (prefix_output, log_dir, or a
# captured stdout), a launch refused at the open-files limit while Pump.__init__ makes its pipes leaks the
# pipes made before the one that failed (its wake pipe, earlier ranks' pipes): __init__ has no cleanup, and
# routed() never gets a Pump to close.
def test_a_launch_refused_while_making_output_pipes_leaves_no_descriptor() -> None:
    same = parallel(nprocs=2, start_method="fork", timeout=60, prefix_output=True)(_same)
    same(0)
    for free in range(1, 12):
        before = _descriptors()
        with _free_descriptors(free), contextlib.suppress(LaunchRefusedError):
            same(free)
        left = {fd: target for fd, target in _descriptors().items() if fd not in before}
        assert not left, f"{free} free descriptors: left {left}"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# Found by a full CI run, on the fork path that opened every pidfd after the last fork: rank 0 ended, and
# the caller's SIGCHLD handler reaped it, while rank 1 was still being forked; its pidfd could not be
# opened ("No such process"), the launch crashed and left rank 1 unreaped. Each pidfd is opened right after
# its fork, before the worker can end. The second fork here waits until rank 0 is gone, which makes it certain.
def test_a_worker_reaped_by_the_caller_while_the_next_one_forks_is_still_waited_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    same = parallel(nprocs=2, start_method="fork", timeout=60)(_same)
    same(0)
    before = _descriptors()

    def after_the_first_is_gone(pids: list[int]) -> None:
        deadline = time.monotonic() + 10
        while pids and not _gone(pids[0]) and time.monotonic() < deadline:  # the handler reaps it meanwhile
            time.sleep(0.01)

    with reaping_sigchld_handler():
        pids = fork_with(monkeypatch, after_the_first_is_gone)
        try:
            assert same(1) == 1
        finally:
            monkeypatch.undo()
    assert all(_gone(pid) for pid in pids)
    left = {fd: target for fd, target in _descriptors().items() if fd not in before}
    assert not left, f"descriptors left: {left}"
    # and its exit is known (a pidfd opened after the handler reaped it could not tell; a CI run's flake)
    if kernel_keeps_reaped_status():
        assert same.last_report is not None
        assert [r.exitcode for r in same.last_report.ranks] == [0, 0], same.last_report
