"""A worker's own bookkeeping, in this process: finding its children, what a forked worker restores."""

from __future__ import annotations

import os
import random
import time
import traceback
from typing import Any

import pytest

from mplaunch._state.snapshot import ForkState, register_state, unregister_state
from mplaunch._worker import children


def _check_children() -> None:
    assert children.children() == []
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(writer)
        os.read(reader, 1)  # until the parent closes its end
        os._exit(7)
    os.close(reader)
    assert children.children() == [pid]
    assert children.running(pid)
    os.close(writer)
    deadline = time.monotonic() + 10
    while children.running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not children.running(pid)
    assert children.children() == [pid]  # ended, not reaped: still this process's to reap
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
    assert children.children() == []


def test_children_are_found_while_running_and_after_ending_and_stay_reapable() -> None:
    """No child: an empty list (answered by one waitid probe). A running child and an ended, unreaped one are
    listed, and probing never reaps a child: its owner (e.g. multiprocessing) still collects its status.
    Checked in a fresh child of the test process, which has children of its own."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _check_children()
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit code and the traceback
            traceback.print_exc()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_fork_state_brings_back_what_fork_does_not_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython reseeds ``random`` in a forked child, and a library may reset its own state at fork: those
    are captured and restored; everything else a fork worker inherits as it is."""
    seen: list[Any] = []

    def restore(value: Any) -> None:
        seen.append(value)

    def capture() -> str:
        return "mode-a"

    register_state(capture, restore)
    try:
        random.seed(1234)
        state = ForkState.capture()
        expected = [random.random() for _ in range(3)]
        random.seed(99)
        state.restore()
        assert [random.random() for _ in range(3)] == expected
        assert seen == ["mode-a"]
    finally:
        unregister_state(capture, restore)
