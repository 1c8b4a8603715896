"""The processes a worker started (DataLoader workers, a tracker's helper, subprocesses), and stopping them.

A worker stays in its caller's process group (the terminal's, in an interactive shell), so it cannot signal
a group of its own. It is a child subreaper instead (see :func:`mplaunch._platform.proctree.become_subreaper`):
a process whose parent ends becomes the worker's child, so the worker's tree in ``/proc`` holds everything
it started, however deep. A child that has ended is a zombie until its owner reaps it: that is left to the
owner (a DataLoader joins its workers itself), and such a child counts as gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from mplaunch._platform.proctree import children_of, descendants, running


def children() -> list[int]:
    """Direct children of this process (Linux: /proc/self/task/*/children), else an empty list."""
    try:  # one system call says whether there are any (WNOWAIT: an ended child stays for its owner to reap)
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return []
    except (OSError, AttributeError):  # no waitid here: list them
        pass
    return children_of(os.getpid())


def stop_children(wait: float, *, kill: bool) -> None:
    """Stop what this worker started: SIGTERM to every descendant, then wait up to ``wait`` seconds for them
    to end; with ``kill``, SIGKILL those still running, and what they start or orphan meanwhile.

    The SIGCHLD handler is reset first, so that, e.g., DataLoader's does not raise about its workers' deaths.

    Args:
        wait: seconds to wait for them to end.
        kill: SIGKILL the descendants still running after ``wait`` (the worker is done); without, they are
            left to end on their own (the worker unwinds, and its parent stops its tree after it exits).
    """
    if not children():
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    """The running descendants of ``pid``."""
    return [child for child in descendants(pid) if running(child)]


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
