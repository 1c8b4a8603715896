"""The processes a worker started (DataLoader workers, a tracker's helper, subprocesses), and stopping them.

A worker makes a process group of its own when it starts, so its children (and theirs) are in it unless they
left it; SIGTERM to the group reaches them all at once. A child that has ended is a zombie until its owner
reaps it: that is left to the owner (a DataLoader joins its workers itself), and such a child counts as gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time


def children() -> list[int]:
    """Direct children of this process (Linux: /proc/self/task/*/children), else an empty list."""
    try:  # one system call says whether there are any (WNOWAIT: an ended child stays for its owner to reap)
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return []
    except (OSError, AttributeError):  # no waitid here: list them
        pass
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as file:
                found.extend(int(pid) for pid in file.read().split())
    return found


def running(pid: int) -> bool:
    """Whether child ``pid`` still runs (a zombie has ended; it is left for its owner to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_children(wait: float, *, kill: bool) -> None:
    """Stop what this worker started: SIGTERM to its process group (or to each child, if it has none of its
    own), then wait up to ``wait`` seconds for the children to end; with ``kill``, SIGKILL those still running.

    The SIGCHLD handler is reset first, so that, e.g., DataLoader's does not raise about its workers' deaths,
    and this worker ignores the SIGTERM it sends its own group (it is stopping, or done, already).

    Args:
        wait: seconds to wait for them to end.
        kill: SIGKILL the children still running after ``wait`` (the worker is done); without, they are left
            to end on their own (the worker unwinds, and its parent kills its group after it exits).
    """
    if not children():
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGTERM)
        else:
            for pid in children():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while (alive := [pid for pid in children() if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.005)
    if kill:
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
