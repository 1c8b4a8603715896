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
    """Send ``signum`` to a worker's main thread (``tgkill``: that interrupts its blocking system call), else to it."""
    pid = process.pid
    if pid is None:
        return
    tgkill = _tgkill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if tgkill is None or tgkill(pid, pid, signum) != 0:
            os.kill(pid, signum)


def kill_tree(process: BaseProcess) -> None:
    """SIGKILL a live, unreaped worker and every process it started (it has no process group of its own)."""
    if process.pid is not None:
        _kill_trees([process.pid])


def kill_leftovers(rank: int, master_port: int) -> None:
    """SIGKILL the orphans of a worker that ended without stopping its tree, found by the environment it gave
    what it executed (Jenkins' ProcessTreeKiller cookie); forked-only ones (DataLoader workers) end alone."""
    _kill_trees(with_environment({WORKER_VARIABLE: "1", "RANK": str(rank), "MASTER_PORT": str(master_port)}))


def _kill_trees(roots: list[int]) -> None:
    """SIGKILL ``roots`` and their descendants, frozen first top down (SIGSTOP: no more forks) until none is new."""
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
    """Send ``signum`` through ``pidfd`` (never to a process that took a reaped worker's pid), else to ``pid``."""
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
