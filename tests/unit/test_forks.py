"""What a child forked from a process that imported mplaunch redoes (mplaunch._platform.forks), and what it
makes anew only when it needs it (the device pool)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

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


def test_every_lock_of_mplaunchs_modules_is_free_in_a_forked_child() -> None:
    """A module's lock that a thread holds at a fork stays held in the child for good: a child that then
    launches (a ``multiprocessing.Pool`` worker) would wait forever. Each is made new there (``new_lock``);
    ``lines._WRITING`` is taken around every fork by its own hooks instead."""
    import mplaunch  # noqa: F401 - every module a launch uses

    lock_type = type(threading.Lock())
    found = sorted(
        f"{name}.{attribute}"
        for name, module in list(sys.modules.items())
        if name == "mplaunch" or name.startswith("mplaunch.")
        for attribute, value in vars(module).items()
        if isinstance(value, lock_type) and not any(value is lock for lock in forks._LOCKS)
    )
    assert found == ["mplaunch._output.lines._WRITING"]


_PARENT = """
import os, sys, time
from mplaunch import parallel
from tests import workers

if __name__ == "__main__":
    ready = sys.argv[1]
    future = parallel(nprocs=1, start_method="fork", timeout=60)(workers.waiting_here).submit(ready, 3)
    while not os.path.exists(f"{ready}.0"):
        time.sleep(0.01)
    pid = os.fork()
    if pid == 0:
{child}
    os.waitpid(pid, 0)
    try:
        print("RESULT", future.result(20))
    except BaseException as error:
        print("FAILED", type(error).__name__, error)
"""


def _forking_parent(tmp_path: Path, child: str) -> list[str]:
    """Run a script that submits a 3 s launch, forks once it runs, and runs ``child`` (Python, its lines
    indented by 8) in the child; return the script's output lines (the parent's last: its future's result)."""
    script = _PARENT.replace("{child}", textwrap.indent(textwrap.dedent(child).strip(), " " * 8))
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ready")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).parents[2]),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def test_a_forked_child_does_not_stop_its_parents_launches_when_it_exits(tmp_path: Path) -> None:
    """A child that ends with a normal exit runs the ``atexit`` handlers it inherited, among them the one that
    stops the running submitted launches: the parent's, whose stop requests it still could write."""
    assert _forking_parent(tmp_path, "sys.exit(0)  # atexit runs here") == ["RESULT 0"]


def test_a_forked_child_cannot_stop_or_wait_for_its_parents_launch(tmp_path: Path) -> None:
    """``future.cancel()`` in a forked child stopped the parent's launch through the shared stop pipe and left
    the parent's future pending for good (``result()`` timed out); ``result()`` there waited for a thread that
    the child does not have. Each raises a ``RuntimeError`` there; the parent's launch is untouched."""
    child = """
        for call in (future.cancel, future.preempt, future.stacks, lambda: future.result(0.1)):
            try:
                call()
                print("CHILD", "ran")
            except RuntimeError as error:
                print("CHILD", "forked from it" in str(error))
        sys.stdout.flush()
        os._exit(0)
    """
    assert _forking_parent(tmp_path, child) == ["CHILD True"] * 4 + ["RESULT 0"]
