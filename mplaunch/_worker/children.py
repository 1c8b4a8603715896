"""Stopping the processes a worker started. It has no process group of its own to signal: as a subreaper, its
tree in ``/proc`` holds all it started. An ended child is left for its owner to reap, and counts as gone."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from mplaunch._platform.proctree import children_of, descendants, running


def children() -> list[int]:
    """Return the direct children of this process."""
    try:  # one system call says whether there are any (WNOWAIT: an ended child stays for its owner to reap)
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return []
    except (OSError, AttributeError):  # no waitid here: list them
        pass
    return children_of(os.getpid())


def stop_children(wait: float, *, kill: bool) -> None:
    """SIGTERM every descendant and wait up to ``wait`` seconds; with ``kill``, SIGKILL those still running."""
    if not children():
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # DataLoader's handler would raise about its workers' deaths
    me = os.getpid()
    _signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + wait
    while _alive(me) and time.monotonic() < deadline:
        time.sleep(0.005)
    if kill:
        for _ in range(100):  # a process forked meanwhile is found on the next round (it is ours: a subreaper)
            alive = _alive(me)
            if not alive:
                break
            _signal_all(alive, signal.SIGKILL)


def _alive(pid: int) -> list[int]:
    """Return the running descendants of ``pid``."""
    return [child for child in descendants(pid) if running(child)]


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
