"""Preemption (preempt_signals, preempt_grace, PreemptedError, future.preempt()) and the restart policy
(restart_on, restart_delay). A preempted launch runs in a script, so that the test can send SIGTERM to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from mplaunch import PreemptedError, WorkerExitedError, parallel
from mplaunch._wire import flags
from tests import workers

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120

SCRIPT = """
    import os, signal, sys
    import mplaunch
    from tests.workers import save_when_preempted

    options = dict(nprocs=2, start_method=sys.argv[1], timeout=120, return_all=True, grace_period=2.0)
    if sys.argv[3] == "preempt":
        options.update(preempt_signals=(signal.SIGTERM,), preempt_grace=float(sys.argv[4]))
    run = mplaunch.parallel(**options)(save_when_preempted)

    if __name__ == "__main__":
        try:
            run(sys.argv[2])
        except mplaunch.PreemptedError as error:
            print("preempted by", error.signal_name, "returned", list(error.returned), "values",
                  sorted(error.values.values()), "stopped", list(error.stopped), flush=True)
            print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
            sys.exit(128 + error.signum)
        print("not preempted", flush=True)
"""


class Launched:
    """A script's launch with its two ranks ready (each reading its DataLoader)."""

    def __init__(self, tmp_path: Path, start_method: str, *args: str) -> None:
        script = tmp_path / "script.py"
        script.write_text(textwrap.dedent(SCRIPT))
        self.directory = tmp_path / "out"
        self.directory.mkdir()
        self.process = subprocess.Popen(
            [sys.executable, str(script), start_method, str(self.directory), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        deadline = time.monotonic() + 90
        while not all((self.directory / f"ready-{rank}").exists() for rank in range(2)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the ranks did not get ready: {self.process.communicate(timeout=30)}")
            time.sleep(0.05)
        self.pids = [int(pid) for rank in range(2) for pid in (self.directory / f"ready-{rank}").read_text().split()]
        assert len(self.pids) == 4  # two ranks and their DataLoader workers

    def finish(self) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=90)
        return self.process.returncode, out, err

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        alive = self.pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in self.pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
            time.sleep(0.05)
        assert not alive, f"processes left: {alive}"
        assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{self.process.pid}-")]


def _flag_raised(parent: int) -> bool:
    """Whether ``parent``'s launch raised its preemption flag (the byte it maps from the launch directory)."""
    for root in {"/dev/shm", tempfile.gettempdir()}:
        for path in Path(root).glob(f"mplaunch-{parent}-*/{flags.FLAG}"):
            with contextlib.suppress(OSError):
                if path.read_bytes()[:1] not in (b"", b"\0"):
                    return True
    return False


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[Launched]]:
    started: list[Launched] = []
    yield started
    for launch in started:
        if launch.process.poll() is None:
            launch.process.kill()
        launch.process.communicate()


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_sigterm_tells_every_rank_which_saves_and_returns(
    tmp_path: Path, launched: list[Launched], start_method: str
) -> None:
    launch = Launched(tmp_path, start_method, "preempt", "60")
    launched.append(launch)
    launch.process.send_signal(signal.SIGTERM)
    code, out, err = launch.finish()
    assert code == 128 + signal.SIGTERM, (out, err)
    assert "preempted by SIGTERM returned [0, 1] values [0, 1] stopped []" in out, (out, err)
    assert "handler restored: True" in out
    for rank in range(2):
        checkpoint = torch.load(launch.directory / f"ckpt_rank{rank}.pt")
        assert checkpoint["rank"] == rank
        assert checkpoint["seen"] >= 2  # one more batch after the notice
    launch.assert_nothing_left()


def test_without_preempt_signals_sigterm_stops_at_once(tmp_path: Path, launched: list[Launched]) -> None:
    launch = Launched(tmp_path, "fork", "plain")
    launched.append(launch)
    launch.process.send_signal(signal.SIGTERM)
    code, out, err = launch.finish()
    assert code == -signal.SIGTERM, (out, err)
    assert not list(launch.directory.glob("ckpt_rank*"))
    launch.assert_nothing_left()


def test_a_second_signal_ends_the_grace_at_once(tmp_path: Path, launched: list[Launched]) -> None:
    """The ranks save and return at once when told; with nothing else to wait for, the second SIGTERM would
    find the launch over: so it is sent while they still run, before the flag is seen (stopped: SIGSTOP)."""
    launch = Launched(tmp_path, "fork", "preempt", "60")
    launched.append(launch)
    ranks = [launch.pids[0], launch.pids[2]]
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)  # the ranks cannot react to the notice: only a second signal ends the grace
    launch.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not _flag_raised(launch.process.pid):  # the parent has noticed the first signal
        assert time.monotonic() < deadline, "the parent did not raise the preemption flag within 30 s"
        time.sleep(0.01)
    start = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    code, out, err = launch.finish()
    assert time.monotonic() - start < 30  # not the 60 s grace
    assert code == 128 + signal.SIGTERM, (out, err)
    assert "returned [] values [] stopped [0, 1]" in out, (out, err)
    launch.assert_nothing_left()


def _hold(directory: str, seconds: float) -> int:
    from mplaunch import preempted, worker_info

    Path(directory, f"ready-{worker_info().rank}").touch()
    deadline = time.monotonic() + seconds
    while not preempted() and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(directory, f"seen-{worker_info().rank}").write_text(str(time.monotonic()))
    if not seconds:
        time.sleep(60)  # ignores the notice: stopped at the end of the grace
    return 7 if preempted() else 0


def test_a_submitted_launch_is_preempted_by_future_preempt(tmp_path: Path) -> None:
    future = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(_hold).submit(str(tmp_path), 60)
    _wait_ready(tmp_path)
    told = time.monotonic()
    assert future.preempt()
    with pytest.raises(PreemptedError) as caught:
        future.result(timeout=TIMEOUT)
    error = caught.value
    assert error.signum is None
    assert error.returned == (0, 1)
    assert error.values == {0: 7, 1: None}
    assert not future.preempt()  # finished
    seen = [float((tmp_path / f"seen-{rank}").read_text()) for rank in range(2)]
    assert all(0 <= when - told < 0.5 for when in seen), [when - told for when in seen]  # ~0.01 s when idle


def _wait_ready(directory: Path, nprocs: int = 2) -> None:
    deadline = time.monotonic() + 60
    while not all((directory / f"ready-{rank}").exists() for rank in range(nprocs)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("limit", ["grace", "timeout"])
def test_ranks_that_ignore_the_notice_are_stopped_after_the_grace(tmp_path: Path, limit: str) -> None:
    """The grace ends, or the launch's timeout ends inside it: the ranks are stopped, and it is a preemption."""
    grace, timeout = (0.5, TIMEOUT) if limit == "grace" else (60.0, 8.0)  # fork ranks start in well under 8 s
    run = parallel(nprocs=2, start_method="fork", preempt_grace=grace, timeout=timeout, grace_period=1.0)(_hold)
    future = run.submit(str(tmp_path), 0.0)  # 0 s: returns only after the stop
    _wait_ready(tmp_path)
    start = time.monotonic()
    future.preempt()
    with pytest.raises(PreemptedError) as caught:
        future.result(timeout=TIMEOUT)
    assert caught.value.stopped == (0, 1)
    assert caught.value.returned == ()
    assert time.monotonic() - start < 15


def _starts(directory: Path) -> list[float]:
    return [float(line) for line in (directory / "starts").read_text().split()]


def test_restart_on_restarts_a_matching_failure_after_growing_delays(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = parallel(
        nprocs=1, start_method="fork", max_restarts=2, restart_on=(ConnectionError,), restart_delay=0.3, timeout=TIMEOUT
    )(workers.record_start_then_raise)
    with pytest.warns(Warning), pytest.raises(ConnectionError) as caught:
        run(str(tmp_path), "connection")
    starts = _starts(tmp_path)
    assert len(starts) == 3
    assert len(caught.value.earlier_attempts) == 2  # type: ignore[attr-defined]
    assert starts[1] - starts[0] >= 0.3
    assert starts[2] - starts[1] >= 0.6
    err = capfd.readouterr().err
    assert "rank 0 failed in attempt 1 of 3; restarting all workers in 0.3 s." in err
    assert "[rank 0]: Traceback (most recent call last):" in err
    assert "[rank 0]: ConnectionError: peer went away" in err


def test_restart_on_raises_another_failure_at_once(tmp_path: Path) -> None:
    run = parallel(nprocs=1, start_method="fork", max_restarts=2, restart_on=(ConnectionError,), timeout=TIMEOUT)(
        workers.record_start_then_raise
    )
    with pytest.raises(ValueError, match="bad input") as caught:
        run(str(tmp_path), "value")
    assert len(_starts(tmp_path)) == 1
    assert caught.value.earlier_attempts == ()  # type: ignore[attr-defined]


def test_a_predicate_decides_in_the_parent_under_spawn(tmp_path: Path) -> None:
    seen: list[BaseException] = []

    def retry(failure: BaseException) -> bool:  # a closure: it cannot be pickled, and need not be
        seen.append(failure)
        return "retry" in str(failure)

    run = parallel(nprocs=1, start_method="spawn", max_restarts=3, restart_on=retry, timeout=TIMEOUT)
    with pytest.warns(Warning):
        assert run(workers.record_start_then_raise)(str(tmp_path), "retry", 1) == 1
    with pytest.raises(RuntimeError, match="fatal"):
        run(workers.record_start_then_raise)(str(tmp_path), "fatal")
    assert [str(error) for error in seen] == ["flaky: retry me", "fatal"]


def test_a_killed_worker_matches_worker_exited_error(tmp_path: Path) -> None:
    run = parallel(nprocs=1, start_method="fork", max_restarts=1, restart_on=(WorkerExitedError,), timeout=TIMEOUT)
    with pytest.warns(Warning, match="SIGKILL"):
        assert run(workers.record_start_then_raise)(str(tmp_path), "kill", 1) == 1
