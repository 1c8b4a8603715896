"""The attempt loop of max_restarts and the futures of submit(), with stand-ins for launches (no process)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest

from mplaunch import LaunchTimeoutError, RestartWarning, WorkerExitedError
from mplaunch._parent.control import LaunchControl, LaunchStopped
from mplaunch._parent.futures import failed, submit
from mplaunch._parent.restarts import describe_restart, run_attempts


def _failing_attempts(control: LaunchControl, failures: list[BaseException], worker: bool = True) -> Any:
    calls: list[int] = []

    def attempt(restart: int) -> Generator[Any, None, list[Any]]:
        calls.append(restart)
        if restart < len(failures):
            if worker:
                control.failure = failures[restart]
            raise failures[restart]
        yield f"value of attempt {restart}"  # an attempt's values reach the caller (a stream's)
        return ["done"]

    return attempt, calls


def _run(attempts: Generator[Any, None, list[Any]]) -> tuple[list[Any], list[Any]]:
    """What the attempts yielded, and what they returned."""
    yielded = []
    while True:
        try:
            yielded.append(next(attempts))
        except StopIteration as stop:
            return yielded, stop.value


def test_worker_failures_are_restarted_until_an_attempt_succeeds() -> None:
    control = LaunchControl()
    attempt, calls = _failing_attempts(control, [ValueError("a"), KeyError("b")])
    with pytest.warns(RestartWarning) as caught:
        assert _run(run_attempts(attempt, 2, control)) == (["value of attempt 2"], ["done"])
    assert calls == [0, 1, 2]
    assert len(caught) == 2
    assert "attempt 1 of 3 failed" in str(caught[0].message)
    assert "ValueError: a" in str(caught[0].message)
    assert "attempt 2 of 3" in str(caught[1].message)
    assert "restart 2 of max_restarts=2" in str(caught[1].message)


def test_other_errors_and_expired_deadlines_end_the_launch_at_once() -> None:
    control = LaunchControl()
    attempt, calls = _failing_attempts(control, [LaunchTimeoutError("late", 1.0, (0,))], worker=False)
    with pytest.raises(LaunchTimeoutError) as caught:
        _run(run_attempts(attempt, 5, control))
    assert calls == [0]
    assert caught.value.earlier_attempts == ()  # type: ignore[attr-defined]
    control = LaunchControl()
    control.start_clock(0.001)
    while control.remaining():  # until the deadline has passed
        time.sleep(0.001)
    attempt, calls = _failing_attempts(control, [ValueError("a")])
    with pytest.raises(ValueError):
        _run(run_attempts(attempt, 5, control))
    assert calls == [0]


def test_a_stop_request_ends_the_loop_before_the_next_attempt() -> None:
    control = LaunchControl()
    control.request_stop()
    with pytest.raises(LaunchStopped):
        _run(run_attempts(_failing_attempts(control, [])[0], 3, control))


def test_restart_message_of_a_worker_exit() -> None:
    error = WorkerExitedError("rank 1 (pid 5) was killed by SIGKILL (exit code -9)", 1, 5, -9)
    text = describe_restart(error, 1, 1)
    assert "attempt 1 of 2 failed (rank 1 (pid 5) was killed by SIGKILL" in text
    assert "TORCHELASTIC_RESTART_COUNT=1" in text


def _stoppable(control: LaunchControl) -> str:
    while not control.stop_requested:
        time.sleep(0.01)
    raise LaunchStopped()


def test_cancel_stops_a_running_launch_and_ends_cancelled() -> None:
    future = submit(_stoppable, LaunchControl(stoppable=True), "stand-in")
    assert future.running()
    assert not future.done()
    done_callbacks: list[bool] = []
    future.add_done_callback(lambda f: done_callbacks.append(f.cancelled()))
    waiter = threading.Thread(target=concurrent.futures.wait, args=([future],))
    waiter.start()
    assert future.cancel()
    assert future.cancelled()
    assert not future.running()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert done_callbacks == [True]
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert future.cancel()  # already cancelled: still True, as concurrent.futures says


def test_a_finished_launch_cannot_be_cancelled_and_keeps_its_result() -> None:
    future = submit(lambda control: 42, LaunchControl(stoppable=True), "stand-in")
    assert future.result(timeout=5) == 42
    assert not future.cancel()
    assert not future.cancelled()
    error = ValueError("refused")
    refused = failed(error)
    assert refused.done()
    assert refused.exception() is error
    assert not refused.cancel()


def test_an_in_process_launch_cannot_be_stopped() -> None:
    control = LaunchControl(stoppable=True)
    control.in_process = True
    release = threading.Event()
    future = submit(lambda control: release.wait(5), control, "stand-in")
    assert not future.cancel()
    assert future.running()
    release.set()
    assert future.result(timeout=5) is True
