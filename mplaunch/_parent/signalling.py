"""The only code that signals a launch's workers: the signal that stops a worker (sent to its main thread),
and SIGKILL for a worker with every process it started, however deep."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import signal
import sys
from multiprocessing.process import BaseProcess
from typing import Any

from mplaunch._env import WORKER_VARIABLE
from mplaunch._platform.proctree import descendants, with_environment


def signal_worker(process: BaseProcess, signum: int) -> None:
    """Send ``signum`` to a worker's main thread (it then stops what it started itself)."""
    pid = process.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        _to_main_thread(pid, signum)


def kill_tree(process: BaseProcess) -> None:
    """SIGKILL a live worker and every process it started, however deep (it stays in its caller's process
    group, so there is no group of its own to kill). The worker is not reaped yet, so its pid is its own."""
    if process.pid is not None:
        _kill_trees([process.pid])


def kill_leftovers(rank: int, master_port: int) -> None:
    """SIGKILL what a worker that ended without stopping its tree (killed by someone else, ``os._exit``) left
    running: its orphans have gone to init, so they are found by the environment that the worker gave them
    when they were executed (``MASTER_PORT`` is this attempt's own). The idea is Jenkins' ProcessTreeKiller
    (its ``BUILD_ID`` cookie). A process forked without ``exec`` shows its exec-time environment, not the
    rank's, and is not found: DataLoader workers end on their own when their rank is gone."""
    cookie = {WORKER_VARIABLE: "1", "RANK": str(rank), "MASTER_PORT": str(master_port)}
    found = with_environment(cookie)
    if found:
        _kill_trees(found)


def _kill_trees(roots: list[int]) -> None:
    """SIGKILL processes ``roots`` and their descendants. The trees are frozen first, top down (SIGSTOP: a
    stopped process forks no more, and a descendant orphaned meanwhile becomes a worker's child, a worker
    being a child subreaper), until a walk of ``/proc`` finds nothing new; then everything found is killed."""
    frozen: list[int] = []
    found = roots
    for _ in range(100):
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        frozen.extend(found)
        found = [child for root in roots for child in descendants(root) if child not in frozen]
        if not found:
            break
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def send_signal(pid: int, pidfd: int | None, signum: int) -> None:
    """Send ``signum`` to process ``pid`` through ``pidfd`` (never to a process that took a reaped worker's
    pid), else by pid.

    Raises:
        ProcessLookupError: the process has ended (and been reaped).
        OSError: the signal could not be sent.
    """
    if pidfd is not None and hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal(pidfd, signum)
    else:
        os.kill(pid, signum)


#: tgkill's system call number by machine (Linux has no libc wrapper before glibc 2.30).
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131, "riscv64": 131, "ppc64le": 250, "s390x": 241}


@functools.lru_cache(maxsize=1)
def _tgkill() -> Any:
    if not sys.platform.startswith("linux") or platform.machine() not in _SYS_TGKILL:
        return None
    return functools.partial(ctypes.CDLL(None, use_errno=True).syscall, _SYS_TGKILL[platform.machine()])


def _to_main_thread(pid: int, signum: int) -> None:
    """Send ``signum`` to the main thread of process ``pid`` (``tgkill``), else to the process.

    A signal sent to a process goes to any of its threads that does not block it. Python runs its handlers in
    the main thread, but a main thread blocked in a system call (a DataLoader waiting for a batch) is woken
    only by a signal delivered to it; otherwise the worker would sit until SIGKILL. A thread-directed signal
    interrupts that call, so the handler runs at once.
    """
    tgkill = _tgkill()
    if tgkill is None or tgkill(pid, pid, signum) != 0:
        os.kill(pid, signum)
