"""What a child forked from a process that imported mplaunch redoes (mplaunch._platform.forks), and what it
makes anew only when it needs it (the device pool)."""

from __future__ import annotations

import os
import threading

from mplaunch._parent import devices
from mplaunch._platform import forks


def _in_child(check: object) -> int:
    """Fork; the child exits 0 if ``check()`` is true, else 1; return the child's exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if check() else 1)  # type: ignore[operator]
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_lock_another_thread_holds_at_the_fork_is_free_in_the_child() -> None:
    lock = forks.new_lock()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(30)
        assert _in_child(lambda: lock.acquire(timeout=5)) == 0  # without the hook: held forever there
        assert lock.locked()  # the parent's lock is still the thread's
    finally:
        release.set()
        thread.join()


def test_callbacks_run_in_the_child_only() -> None:
    ran: list[int] = []
    forks.in_child(lambda: ran.append(os.getpid()))
    try:
        assert _in_child(lambda: ran == [os.getpid()]) == 0
        assert ran == []
    finally:
        forks._CALLBACKS.pop()


def test_a_forked_child_has_a_device_pool_of_its_own() -> None:
    """A rank that launches in turn with devices= must not wait for devices its parent's launches hold."""
    parents = devices.pool()
    with parents._condition:
        parents._busy.add(0)  # as a launch of this process holding device 0
    try:
        assert _in_child(lambda: devices.pool() is not parents and devices.pool().busy() == frozenset()) == 0
        assert devices.pool() is parents
        assert devices.pool().busy() == {0}
    finally:
        with parents._condition:
            parents._busy.discard(0)
