"""Helpers shared by test files: scripts written to ``tmp_path`` and run in a fresh interpreter, a free port."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import psutil
import pytest

from mplaunch._platform import pidfd as pidfd_module

#: The repository root: on ``PYTHONPATH`` of every script, so that it imports this checkout's mplaunch.
REPO = Path(__file__).resolve().parents[1]


def main_thread_in(function_name: str, path_end: str = "") -> bool:
    """Whether this process's main thread is inside ``function_name`` of a file whose path ends with
    ``path_end`` (any file when empty): the point another thread of a test waits for before it acts."""
    frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function_name and frame.f_code.co_filename.endswith(path_end):
            return True
        frame = frame.f_back
    return False


def free_port() -> int:
    """A TCP port that was free a moment ago (for a rendezvous endpoint the test names itself), drawn below the
    kernel's ephemeral range: a port that a store of another test running meanwhile (pytest-xdist) binds as
    port 0 is never it. A port 0 picked and released here could be given to that store before the test used it."""
    low = 20000
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low = min(low, int(ranges.read().split()[0]) - 2000)
    generator = random.SystemRandom()
    for _ in range(100):
        port = generator.randrange(max(1024, low - 10000), low)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("", port))
            return port
    raise RuntimeError("no free TCP port found below the ephemeral range")


def write_script(tmp_path: Path, body: str) -> Path:
    """Write ``body`` (dedented) to ``tmp_path/script.py`` and return its path."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return script


def run_script(
    script: Path, *args: str, timeout: float = 120, tmpdir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``args`` in a fresh interpreter in the script's folder; ``timeout`` in seconds.

    ``tmpdir``: the script's ``TMPDIR``, when the test counts the files left in it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if tmpdir is not None:  # a temp dir of its own, so that other processes' files do not count
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=script.parent,
    )


def assert_gone(pids: list[int], within: float) -> None:
    """Fail (killing them) unless every process in ``pids`` has ended (a zombie has) within ``within`` s."""
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes still alive after {within} s: {alive}")


def gone(pids: list[int], within: float = 10.0) -> bool:
    """Whether every process in ``pids`` has ceased to exist (reaped) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def started_nodes(command: list[str], env: dict[str, str], port: int) -> Iterator[list[subprocess.Popen[str]]]:
    """Start two "nodes" of a multi-node launch on this machine, each running ``command`` with ``env``; the
    first hosts the rendezvous store on ``port``, and the second starts once it listens. Yield them; kill
    what is left at the end."""
    nodes: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            deadline = time.monotonic() + 60
            while len(nodes) == 1 and time.monotonic() < deadline:  # the store of the first node is listening
                with socket.socket() as sock, contextlib.suppress(OSError):
                    sock.connect(("127.0.0.1", port))
                    break
                time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
            node.communicate()


def outputs_of(nodes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each of ``nodes``' standard output once it ended, waiting at most ``timeout`` seconds for each; kill
    those still running if waiting fails."""
    try:
        return [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()


def kernel_keeps_reaped_status() -> bool:
    """Whether a pidfd still gives the exit status of a process someone else reaped (Linux 6.15+)."""
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    pidfd = os.pidfd_open(pid)
    try:
        os.waitpid(pid, 0)
        return pidfd_module.reaped_status(pidfd) is not None
    finally:
        os.close(pidfd)


@contextlib.contextmanager
def reaping_sigchld_handler() -> Iterator[list[int]]:
    """A caller's SIGCHLD handler that reaps every child (``os.waitpid(-1, os.WNOHANG)`` in a loop, a common
    server pattern) while the block runs, then the handler found before; yields the pids it reaped."""
    reaped: list[int] = []

    def reap_all(signum: int, frame: object) -> None:
        with contextlib.suppress(ChildProcessError):
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                reaped.append(pid)

    previous = signal.signal(signal.SIGCHLD, reap_all)
    try:
        yield reaped
    finally:
        signal.signal(signal.SIGCHLD, previous)


def fork_with(monkeypatch: pytest.MonkeyPatch, before: Callable[[list[int]], None]) -> list[int]:
    """Make ``os.fork`` call ``before(pids)`` in the parent before each fork (``pids``: the children forked
    so far), for the rest of the test (``monkeypatch.undo()`` ends it); return that list of pids. Every way
    mplaunch forks a worker goes through ``os.fork``."""
    fork, pids = os.fork, list[int]()

    def forking() -> int:
        if os.getpid() == parent:
            before(pids)
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    parent = os.getpid()
    monkeypatch.setattr(os, "fork", forking)
    return pids


_STAND_IN_DRIVER = """
static int initialised;
int cuInit(unsigned int flags) { initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 2; return 0; }
"""


def stand_in_cuda_driver(tmp_path: Path) -> Path:
    """Build a ``libcuda.so.1`` with 2 devices that answers as the driver does (``cuDeviceGetCount``:
    CUDA_ERROR_NOT_INITIALIZED until ``cuInit``) and return its folder, for ``LD_LIBRARY_PATH``; skip the
    test without a C compiler."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    (tmp_path / "driver.c").write_text(_STAND_IN_DRIVER)
    folder = tmp_path / "driver"
    folder.mkdir()
    command = [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(folder / "libcuda.so.1"), "driver.c"]
    subprocess.run(command, cwd=tmp_path, check=True)
    return folder
