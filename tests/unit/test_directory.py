"""Launch directories: where they go, whose they are, and which stale ones a launch removes, in one process."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from mplaunch._parent import directory as launch_dir


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped) just now."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def make(root: Path, name: str) -> Path:
    """A directory named ``name`` holding what a launch leaves: a payload and an outcome with its data."""
    directory = root / name
    directory.mkdir()
    for file in ("payload.pkl", "rank0.pkl", "rank0.bin"):
        (directory / file).write_bytes(b"x" * 10)
    return directory


def test_only_directories_of_dead_parents_of_this_pid_namespace_are_removed(tmp_path: Path) -> None:
    namespace, dead, alive = launch_dir._pid_namespace(), dead_pid(), os.getpid()
    assert not launch_dir._pid_alive(dead)
    assert launch_dir._pid_alive(alive)
    stale = [make(tmp_path, f"mplaunch-{dead}-{namespace}-k2x9q"), make(tmp_path, f"mplaunch-{dead}-{namespace}-")]
    kept = [
        make(tmp_path, f"mplaunch-{alive}-{namespace}-a8c1z"),  # a running launch of this process
        make(tmp_path, f"mplaunch-{dead}-{namespace}1-a8c1z"),  # another namespace whose number starts alike
        make(tmp_path, f"mplaunch-{dead}-9{namespace}-a8c1z"),
        make(tmp_path, f"mplaunch-{dead}-0-a8c1z"),  # a namespace that could not be read
        make(tmp_path, f"mplaunch-{dead}-{namespace}"),  # not a name mkdtemp makes
        make(tmp_path, f"mplaunch-{dead}"),
        make(tmp_path, f"mplaunch-x{dead}-{namespace}-a8c1z"),
        make(tmp_path, f"mplaunch-{namespace}-a8c1z"),
        make(tmp_path, f"other-{dead}-{namespace}-a8c1z"),  # not mplaunch's
        make(tmp_path, f"mplaunch{dead}-{namespace}-a8c1z"),
    ]
    launch_dir.remove_stale_directories(str(tmp_path))
    assert not any(directory.exists() for directory in stale)
    assert sorted(os.listdir(tmp_path)) == sorted(directory.name for directory in kept)
    assert all(sorted(os.listdir(directory)) == ["payload.pkl", "rank0.bin", "rank0.pkl"] for directory in kept)


def test_a_pid_that_cannot_be_signalled_counts_as_alive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another user's process (EPERM) is alive: its launch directory must be kept."""

    def refuse(pid: int, signum: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refuse)
    assert launch_dir._pid_alive(dead_pid())
    kept = make(tmp_path, f"mplaunch-{dead_pid()}-{launch_dir._pid_namespace()}-a8c1z")
    launch_dir.remove_stale_directories(str(tmp_path))
    assert kept.exists()


def test_the_namespace_is_this_processs() -> None:
    namespace = launch_dir._pid_namespace()
    assert namespace.isdigit()
    assert os.readlink("/proc/self/ns/pid") == f"pid:[{namespace}]"
    assert launch_dir.own_prefix() == f"mplaunch-{os.getpid()}-{namespace}-"


def test_a_namespace_that_cannot_be_read_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(path: str) -> str:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "readlink", unreadable)
    assert launch_dir._pid_namespace() == "0"


def test_shm_root_is_the_users_choice_else_dev_shm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MPLAUNCH_SHM_DIR", str(tmp_path))
    assert launch_dir.shm_root() == str(tmp_path)
    monkeypatch.delenv("MPLAUNCH_SHM_DIR")
    writable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    assert launch_dir.shm_root() == ("/dev/shm" if writable else tempfile.gettempdir())


def test_a_forked_child_closes_only_the_reaper_pipes_open_now(tmp_path: Path) -> None:
    """A reaper that died is replaced and its pipe closed; a child forked later must not close a descriptor
    that reuses the old pipe's number (it would close the child's own file)."""
    root = str(tmp_path)
    launch_dir._start_reaper(root)
    first = launch_dir._reapers[(os.getpid(), root)]
    os.kill(first, 9)
    os.waitpid(first, 0)  # ended: the next launch starts a new reaper and closes the old pipe
    launch_dir._start_reaper(root)
    second = launch_dir._reapers[(os.getpid(), root)]
    assert second != first
    reader, writer = os.pipe()  # may take the old pipe's number
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.fstat(reader)
                os.fstat(writer)
                os._exit(0)
            except OSError:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(reader)
        os.close(writer)
        os.kill(second, 9)
        os.waitpid(second, 0)
        from mplaunch._parent import processes

        processes.forget_reaper(second)
        del launch_dir._reapers[(os.getpid(), root)]
