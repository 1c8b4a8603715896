"""A container's small /dev/shm (issue 21): results the caller keeps hold none of it, and arguments and results
larger than it travel through anonymous memory files."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mplaunch import StartMethod, parallel
from mplaunch._parent import memfiles
from mplaunch._wire import inherited
from tests import workers
from tests.helpers import run_script, write_script

_TMPFS_MIB = 16


def _has_memory_files() -> bool:
    fd = inherited.memory_file("probe")
    inherited.close_quietly(fd)
    return fd is not None


def _used(root: str) -> int:
    stats = os.statvfs(root)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real 16 MiB tmpfs as mplaunch's shared-memory directory (``MPLAUNCH_SHM_DIR``), as Docker's /dev/shm."""
    root = tmp_path / "shm"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={_TMPFS_MIB}m", "tmpfs", str(root)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        monkeypatch.setenv("MPLAUNCH_SHM_DIR", str(root))
        yield str(root)
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(root)], check=False, timeout=30)


@pytest.mark.parametrize("memory_files", [True, False], ids=["memfd", "files"])
def test_kept_results_hold_no_shared_memory(
    small_shm: str, memory_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep that keeps each trial's 5 MiB result failed on the 4th call with "No space left" in a 16 MiB
    /dev/shm: the results were mapped from unlinked files, which stay charged while mapped. With memory files
    they never touch it; without (``files``) the parent copies them into its own memfiles."""
    if not memory_files:
        monkeypatch.setattr(memfiles, "memory_file", lambda name: None)
    elif not _has_memory_files():
        pytest.skip("no memfd_create here")
    trial = parallel(nprocs=1, start_method="fork", timeout=120)(workers.big_result)
    kept = []
    for _ in range(6):
        kept.append(trial(5)["tensor"])
        assert _used(small_shm) < 2**20, f"{_used(small_shm)} bytes of the tmpfs still used after the call"
    assert all(float(t[-1]) == 5 * 2**18 - 1 for t in kept)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_arguments_and_results_larger_than_shared_memory(small_shm: str, start_method: StartMethod) -> None:
    """32 MiB in and out through a 16 MiB /dev/shm: raw torch.multiprocessing fails ("Bus error"), and so did
    mplaunch ("No space left"; the error asked for --shm-size)."""
    if not _has_memory_files():
        pytest.skip("no memfd_create here")
    big = torch.ones(8 * 2**20)  # 32 MiB
    (back,), _ = parallel(nprocs=2, start_method=start_method, timeout=120)(workers.identity)(big)
    assert back.numel() == big.numel() and float(back.sum()) == big.numel()
    assert _used(small_shm) < 2**20


# Limits met while workers start. Each scenario runs in a script of its own, with the limit set there: a first
# launch starts the helpers (reaper, fork server, resource tracker), then the limit is set and a second launch
# must fail with a LaunchRefusedError naming the limit, leaving no process, descriptor or launch directory.
_SCENARIO = """
import json, os, resource, sys
sys.path.insert(0, {root!r})
import psutil
from mplaunch import parallel
from tests import workers

def state():
    fds = set(os.listdir("/proc/self/fd"))
    children = {{p.pid for p in psutil.Process().children(recursive=True)}}
    shm = os.environ.get("MPLAUNCH_SHM_DIR", "/dev/shm")
    launches = {{e for e in os.listdir(shm) if e.startswith(f"mplaunch-{{os.getpid()}}-")}}
    return fds, children, launches

if __name__ == "__main__":
    call = parallel(nprocs=2, start_method={start_method!r}, timeout=60)(workers.identity)
    call(1)
    before = state()
{limit}
    try:
        outcome = {{"returned": call(1)}}
    except BaseException as error:
        outcome = {{"type": type(error).__name__, "message": str(error)}}
    after = state()
    outcome["fds"] = sorted(after[0] - before[0])
    outcome["children"] = sorted(after[1] - before[1])
    outcome["launches"] = sorted(after[2])
    print(json.dumps(outcome))
"""
_ROOT = str(Path(__file__).parents[2])


def _run_scenario(tmp_path: Path, start_method: str, limit: str) -> dict[str, object]:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO.format(root=_ROOT, start_method=start_method, limit=limit))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=_ROOT, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["fds"] == [] and outcome["children"] == [] and outcome["launches"] == [], outcome
    return outcome


def _pids_cgroup() -> str | None:
    """A directory where a new cgroup with a ``pids.max`` can be made (cgroup v1 ``pids`` or v2), or None."""
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            left, _, right = line.partition(" - ")
            kind, options = right.split()[0], right.split()[-1] if right.split() else ""
            point = left.split()[4]
            if kind == "cgroup" and "pids" in options.split(","):
                return point
            if kind == "cgroup2" and os.path.exists(os.path.join(point, "cgroup.subtree_control")):
                with open(os.path.join(point, "cgroup.subtree_control")) as control:
                    if "pids" in control.read().split():
                        return point
    return None


@contextlib.contextmanager
def _process_limit(room: int) -> Iterator[str]:
    """Script lines that leave room for ``room`` more processes or threads: a new cgroup with ``pids.max``
    (as Docker's ``--pids-limit``) holding the script and its fork server, where this process may make one,
    else ``RLIMIT_NPROC`` for a user that is not root (root is exempt from it)."""
    base = _pids_cgroup()
    cgroup = None
    if base is not None and os.access(base, os.W_OK):
        candidate = os.path.join(base, f"mplaunch-test-{os.getpid()}")
        with contextlib.suppress(OSError):
            os.mkdir(candidate)
            cgroup = candidate
    if cgroup is None:
        if os.geteuid() == 0:
            pytest.skip("no cgroup with a pids controller can be made here, and RLIMIT_NPROC does not bind root")
        yield (
            "    used = sum(len(os.listdir(f'/proc/{p.pid}/task')) for p in psutil.process_iter() "
            "if p.uids().real == os.getuid())\n"
            "    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]\n"
            f"    resource.setrlimit(resource.RLIMIT_NPROC, (used + {room}, hard))"
        )
        return
    try:
        yield (
            "    import multiprocessing.forkserver\n"
            "    server = multiprocessing.forkserver._forkserver._forkserver_pid\n"
            f"    for pid in [os.getpid()] + ([server] if server else []):\n"
            f"        with open({cgroup!r} + '/cgroup.procs', 'w') as procs:\n"
            "            procs.write(str(pid))\n"
            f"    current = int(open({cgroup!r} + '/pids.current').read())\n"
            f"    open({cgroup!r} + '/pids.max', 'w').write(str(current + {room}))"
        )
    finally:
        deadline = time.monotonic() + 30
        while True:  # empty once the script, its fork server and its reaper are gone
            try:
                os.rmdir(cgroup)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_the_process_limit_is_named(tmp_path: Path, start_method: str) -> None:
    """The container's process limit reached while workers start: fork raised a bare "BlockingIOError:
    [Errno 11]", a fork server died of it ("EOFError: unexpected EOF") and was left a zombie. Under fork there
    is room for rank 0 (stopped when rank 1 cannot start); spawn's parent may have a thread fewer when it starts
    them, so there is room for none there."""
    with _process_limit(1 if start_method == "fork" else 0) as limit:
        outcome = _run_scenario(tmp_path, start_method, limit)
    assert outcome["type"] == "LaunchRefusedError", outcome
    message = str(outcome["message"])
    assert "process limit" in message and ("pids.max" in message or "RLIMIT_NPROC" in message), message
    assert "--pids-limit" in message and "ulimit -u" in message


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_an_environment_too_large_for_exec_is_named(tmp_path: Path, start_method: str) -> None:
    """A 2 MB environment variable: a spawn worker's exec failed with E2BIG after its fork, and it "exited with
    code 255"; a new fork server's did too (BrokenPipeError)."""
    limit = "    multiprocessing.forkserver._forkserver._stop()\n" if start_method == "forkserver" else ""
    limit = ("    import multiprocessing.forkserver\n" + limit) + "    os.environ['BIG'] = 'x' * 2_000_000"
    outcome = _run_scenario(tmp_path, start_method, limit)
    assert outcome["type"] == "LaunchRefusedError", outcome
    message = str(outcome["message"])
    assert "BIG" in message and "E2BIG" in message and "start_method='fork'" in message, message


def test_fork_needs_no_exec_for_a_large_environment(tmp_path: Path) -> None:
    outcome = _run_scenario(tmp_path, "fork", "    os.environ['BIG'] = 'x' * 2_000_000")
    assert outcome.get("returned") == [[1], {}], outcome


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_the_open_files_limit_is_named(tmp_path: Path, start_method: str) -> None:
    """A low open-files limit: a bare "OSError: [Errno 24]", or "EOFError" from a fork server that died of it,
    and fork's pipes left open."""
    limit = (
        "    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 4, hard))"
    )
    outcome = _run_scenario(tmp_path, start_method, limit)
    assert outcome["type"] == "LaunchRefusedError", outcome
    message = str(outcome["message"])
    assert "RLIMIT_NOFILE" in message and "ulimit -n" in message, message


def test_a_forked_worker_holds_no_other_launchs_memory_files() -> None:
    """A forked worker inherits every descriptor of its parent: the memory files of other launches running at
    the time (``submit()``) would stay alive until it exits. It keeps only its own outcome's."""
    if not _has_memory_files():
        pytest.skip("no memfd_create here")
    other = inherited.memory_file("rank0")
    try:
        seen = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True)(workers.memory_files_seen)()
    finally:
        inherited.close_quietly(other)
    assert [len(files) for files in seen] == [1, 1], seen


LONG_TMPDIR = """
import multiprocessing.util
from mplaunch import parallel
from tests import workers

if __name__ == "__main__":
    print("returned", parallel(nprocs=2, start_method="forkserver", timeout=60)(workers.identity)(7), flush=True)
    print("socket directory", multiprocessing.util.get_temp_dir(), flush=True)
"""


def test_a_fork_server_starts_under_a_tmpdir_too_long_for_a_unix_socket(tmp_path: Path) -> None:
    """A TMPDIR deep in a cluster's scratch space: multiprocessing put the fork server's socket there and
    failed with a bare "OSError: AF_UNIX path too long" (Python 3.10 to 3.12). Its socket goes to /tmp, and
    the directory made for it is gone when the script ends."""
    deep = tmp_path / ("scratch-" + "x" * 40) / ("job-" + "y" * 40)
    deep.mkdir(parents=True)
    done = run_script(write_script(tmp_path, LONG_TMPDIR), tmpdir=deep)
    assert done.returncode == 0, done.stderr
    assert "returned ((7,), {})" in done.stdout, done.stdout + done.stderr
    used = done.stdout.split("socket directory ", 1)[1].strip()
    assert used.startswith("/tmp/pymp-"), used
    assert not os.path.exists(used)  # removed at exit, as multiprocessing removes its own
    assert list(deep.iterdir()) == []
