"""Preemption and restart options without processes: validation, the delay schedule, the restart filter, the
flag, the notice and its signal handlers, PreemptedError."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mplaunch import InvalidOptionError, WorkerExitedError, parallel, preempted, worker_info
from mplaunch._parent.control import LaunchControl
from mplaunch._parent.outcomes import Stopped
from mplaunch._parent.preemption import Preemption, preempt_signals, preemption_notice
from mplaunch._parent.restarts import MAX_DELAY, pause, restart_delay_of, restartable
from mplaunch._wire import flags
from mplaunch._wire.records import Returned
from tests.helpers import main_thread_in


def test_defaults_keep_todays_behaviour() -> None:
    config = parallel(lambda: None).config
    assert config.preempt_signals == ()
    assert config.preempt_grace == 60.0
    assert config.restart_on is None
    assert config.restart_delay == 0.0


def test_preempt_signals_are_normalised() -> None:
    config = parallel(preempt_signals=[15, signal.SIGUSR1, signal.SIGTERM])(lambda: None).config
    assert config.preempt_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert all(isinstance(s, signal.Signals) for s in config.preempt_signals)
    assert parallel(preempt_signals=signal.SIGUSR2)(lambda: None).config.preempt_signals == (signal.SIGUSR2,)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((signal.SIGKILL,), "SIGKILL cannot be caught"),
        ((signal.SIGSTOP,), "SIGSTOP cannot be caught"),
        # every worker's end sends SIGCHLD: each launch was preempted by it
        ((signal.SIGCHLD,), "SIGCHLD comes to the launching process whenever a worker ends"),
        ((signal.SIGPIPE,), "SIGPIPE comes when a write finds a pipe closed"),
        ((signal.SIGSEGV,), "SIGSEGV reports a crash"),
        ((signal.SIGBUS, signal.SIGFPE), "SIGBUS reports a crash"),
        ((signal.SIGILL,), "SIGILL reports a crash"),
        (("SIGTERM",), "preempt_signals=.*pass a tuple of signals"),
        ("SIGTERM", "pass a tuple of signals"),
        ((True,), "pass a tuple"),
        ((10_000,), "10000 is no signal"),
        (None, "pass a tuple"),
    ],
)
def test_bad_preempt_signals_are_refused(value: Any, match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        parallel(preempt_signals=value)


@pytest.mark.parametrize("name", ["preempt_grace", "restart_delay"])
@pytest.mark.parametrize("value", [-1, "5", float("inf"), None, True])
def test_bad_seconds_are_refused(name: str, value: Any) -> None:
    with pytest.raises(InvalidOptionError, match=f"{name}=.*number of seconds >= 0"):
        parallel(**{name: value})


def test_restart_on_takes_classes_or_a_predicate() -> None:
    assert parallel(restart_on=ConnectionError)(lambda: None).config.restart_on == (ConnectionError,)
    both = (ConnectionError, WorkerExitedError)
    assert parallel(restart_on=both)(lambda: None).config.restart_on == both

    def predicate(failure: BaseException) -> bool:
        return True

    assert parallel(restart_on=predicate)(lambda: None).config.restart_on is predicate


@pytest.mark.parametrize(
    ("value", "named"), [(int, "<class 'int'>"), ((ValueError, str), "<class 'str'>"), ((ValueError, 1), "1"), (3, "3")]
)
def test_restart_on_refuses_what_is_not_an_exception_class(value: Any, named: str) -> None:
    with pytest.raises(InvalidOptionError, match="restart_on=") as caught:
        parallel(restart_on=value)
    assert named in str(caught.value)
    assert "exception classes" in str(caught.value)


def test_options_replace_the_new_options_too() -> None:
    fn = parallel(lambda: None).options(preempt_signals=(signal.SIGUSR1,), restart_delay=2)
    assert fn.config.preempt_signals == (signal.SIGUSR1,)
    assert fn.config.restart_delay == 2.0


def test_the_delay_doubles_from_restart_to_restart_up_to_a_minute() -> None:
    assert [restart_delay_of(n, 0.3) for n in (1, 2, 3)] == pytest.approx([0.3, 0.6, 1.2])
    assert restart_delay_of(20, 0.3) == MAX_DELAY == 60.0
    assert restart_delay_of(10_000, 5) == MAX_DELAY
    assert restart_delay_of(3, 0.0) == 0.0


def test_restartable() -> None:
    error = ConnectionError("x")
    assert restartable(error, None)
    assert restartable(error, (OSError,))
    assert not restartable(error, (ValueError,))
    assert restartable(error, lambda failure: "x" in str(failure))
    assert not restartable(error, lambda failure: False)


def _once_paused(action: Callable[[], object]) -> threading.Thread:
    """Run ``action`` in another thread once the main thread waits in ``pause``."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while not main_thread_in("pause") and time.monotonic() < deadline:
            time.sleep(0.001)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_stop_request_or_a_notice_cuts_the_pause_short() -> None:
    control = LaunchControl(stoppable=True)
    stopper = _once_paused(control.request_stop)
    start = time.monotonic()
    pause(30, control)
    assert time.monotonic() - start < 10
    stopper.join()
    control.close()
    control = LaunchControl()
    notice = Preemption(60)
    control.set_preemption(notice)
    notifier = _once_paused(lambda: notice.notify(signal.SIGTERM))
    start = time.monotonic()
    pause(30, control)
    assert time.monotonic() - start < 10
    notifier.join()
    notice.close()


def test_the_flag_is_seen_through_a_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "_mapping", None)
    monkeypatch.setattr(flags, "_looked", False)
    assert not preempted()
    assert not worker_info().preempted
    notice = Preemption(60)
    notice.attach(str(tmp_path))
    try:
        monkeypatch.setenv(flags.FLAG_VARIABLE, str(tmp_path / flags.FLAG))  # a process a worker started
        monkeypatch.setattr(flags, "_looked", False)  # looked once per process: this one starts anew
        assert not preempted()
        notice.notify(signal.SIGUSR1)
        assert preempted()
        assert worker_info().preempted
        assert notice.signum == signal.SIGUSR1
        assert not notice.forced
        assert 59 < (notice.remaining() or 0) <= 60
        notice.notify(signal.SIGUSR1)
        assert notice.forced
        assert notice.remaining() == 0.0
    finally:
        notice.close()
        flag = flags._mapping
        if flag is not None:
            flag.close()


def test_a_nodes_own_signal_after_another_nodes_notice_is_its_first() -> None:
    """A scheduler preempting a two-node job signals both nodes; node 0 heard of node 1's signal first, and
    its own signal then counted as a second notice: the grace ended at once and no rank saved. Only this
    process's own second notice forces the end."""
    notice = Preemption(60)
    try:
        notice.notify(signal.SIGTERM, origin=1)  # passed on by node 1
        notice.notify(signal.SIGTERM)  # this node's own, just after
        assert not notice.forced and 59 < (notice.remaining() or 0) <= 60
        assert notice.origin == 1  # (the notice is the one first heard of)
        notice.notify(signal.SIGTERM, origin=1)
        assert not notice.forced
        notice.notify(signal.SIGTERM)  # this node's second
        assert notice.forced and notice.remaining() == 0.0
    finally:
        notice.close()


def test_a_notice_before_the_flag_exists_raises_it_when_made(tmp_path: Path) -> None:
    control = LaunchControl(stoppable=True)
    control.preempt()  # future.preempt() before the launch started
    with preemption_notice(control, str(tmp_path), (), 60) as notice:
        assert notice.noticed
        assert notice.signum is None
        assert not notice.forced
        assert (tmp_path / flags.FLAG).read_bytes() == b"\1"
    assert control.preemption is None
    control.close()


def test_the_handlers_are_put_back_and_an_unreported_signal_passes_on() -> None:
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        notice = Preemption(60)
        with preempt_signals(notice, (signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
            assert notice.noticed
            assert got == []  # told, not handled
        assert got == [signal.SIGUSR1]  # the launch ended without reporting it: the caller's handler gets it
        notice.close()
        notice = Preemption(60)
        with preempt_signals(notice, (signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
            notice.error({}, 1)  # reported
        assert got == [signal.SIGUSR1]
        notice.close()
        notice = Preemption(60)
        with pytest.raises(KeyboardInterrupt), preempt_signals(notice, (signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
            raise KeyboardInterrupt  # e.g. Ctrl-C during the grace: the call ends with it, the notice is not passed on
        assert got == [signal.SIGUSR1]
        notice.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preempted_error_carries_what_happened_and_pickles() -> None:
    notice = Preemption(5)
    notice.notify(signal.SIGTERM)
    failure = ValueError("while saving")
    error = notice.error({0: Returned(1, "weights"), 1: Stopped(1), 2: failure}, 4)
    assert error.signum == signal.SIGTERM
    assert error.signal_name == "SIGTERM"
    assert error.returned == (0,)
    assert error.values == {0: "weights"}
    assert error.stopped == (1, 3)
    assert error.failures == (failure,)
    assert "preempt_grace=5 s" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.signum, copy.returned, copy.values, copy.stopped, str(copy)) == (
        error.signum,
        error.returned,
        error.values,
        error.stopped,
        str(error),
    )
    notice.close()


def _nothing() -> None:
    pass
