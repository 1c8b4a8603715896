"""Issue 22: when a run hangs, stalls or dies without a word, the launch says which rank, where, and why."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mplaunch import LaunchTimeoutError, StallError, StartMethod, WorkerExitedError, parallel
from mplaunch._parent import usage as report_module
from mplaunch._platform.oom import oom_counters
from mplaunch._wire.board import STACKS_SIGNAL
from tests import workers
from tests.helpers import fork_with, kernel_keeps_reaped_status, reaping_sigchld_handler

ALL = pytest.mark.parametrize("start_method", ["fork", "forkserver", pytest.param("spawn", marks=pytest.mark.slow)])


def _start_allowance(start_method: str) -> float:
    """Seconds to add to a launch's ``timeout`` so that its ranks reach the function before it ends: twice
    what a no-op launch takes now for spawn (each worker imports torch: seconds on a busy two-core machine,
    and a fixed allowance made the spawn case wait 30 s); nothing for fork and forkserver."""
    if start_method != "spawn":
        return 0.0
    start = time.monotonic()
    parallel(nprocs=2, start_method="spawn", timeout=120)(workers.identity)(None)
    return 2.0 * (time.monotonic() - start)


def _wait_for(paths: list[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {paths}"
        time.sleep(0.02)


@ALL
def test_timeout_names_where_each_rank_was(start_method: str, tmp_path: Path) -> None:
    timeout = 4.0 + _start_allowance(start_method)
    run = parallel(nprocs=2, start_method=start_method, timeout=timeout, grace_period=1.0, log_dir=str(tmp_path))(  # type: ignore[call-overload]
        workers.stuck_or_in_barrier
    )
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        run(120)
    took = time.monotonic() - start
    error = caught.value
    assert took < timeout + 2.5 + (8.0 if start_method == "forkserver" else 0.0)  # the first server starts
    assert set(error.stacks) == {0, 1}
    assert "stuck_here" in error.stacks[0]
    assert "barrier" in error.stacks[1]
    assert all(" in __call__" not in stack for stack in error.stacks.values())  # no frame of the caller's side
    message = str(error)
    assert "rank 0 in stuck_here (" in message
    assert "rank 1 in stuck_or_in_barrier (" in message
    assert f"and in {tmp_path / 'rank{N}.stacks'} (N: the rank)" in message  # the directory given, not a template
    assert (tmp_path / "rank0.stacks").read_text() == error.stacks[0]
    assert "barrier" in (tmp_path / "rank1.stacks").read_text()
    copy = pickle.loads(pickle.dumps(error))
    assert copy.stacks == error.stacks
    assert copy.running == (0, 1)
    assert copy.report == error.report
    assert error.report is not None
    assert [r.rank for r in error.report.ranks] == [0, 1]


def test_a_rank_blocked_in_a_c_call_still_dumps(tmp_path: Path) -> None:
    ready = str(tmp_path / "ready")
    run = parallel(nprocs=2, start_method="fork", timeout=3.0, grace_period=0.5)(workers.blocked_in_read)
    with pytest.raises(LaunchTimeoutError) as caught:
        run(ready)
    for rank in (0, 1):
        assert "blocked_in_read" in caught.value.stacks[rank]
    assert "rank 0 in blocked_in_read (" in str(caught.value)


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_stall_timeout_catches_the_silent_rank_and_names_it(start_method: str) -> None:
    run = parallel(nprocs=2, start_method=start_method, timeout=90, stall_timeout=1.0, grace_period=1.0)(  # type: ignore[call-overload]
        workers.beat_then_fall_silent
    )
    with pytest.raises(StallError) as caught:
        run(1, 5, 0.05)
    error = caught.value
    assert error.rank == 1
    assert error.silent >= 1.0
    assert error.stall_timeout == 1.0
    assert "rank 1 (pid" in str(error)
    assert "stalled" in str(error)
    assert "rank 1 in silent_here (" in str(error)
    assert "beat_then_fall_silent" in error.stacks[0]
    assert "silent_here" in error.stacks[1]
    assert isinstance(error, WorkerExitedError.__mro__[1])  # a WorkerFailedError
    assert pickle.loads(pickle.dumps(error)).silent == error.silent


def test_ranks_that_keep_beating_or_never_beat_are_not_stopped() -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=60, stall_timeout=0.5, return_all=True)(workers.beat_or_not)
    assert run((0,), 2.0, 0.05) == [0, 1]  # rank 0 beats every 0.05 s, rank 1 never: neither is a stall


def test_a_stall_restarts_with_max_restarts() -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=60, stall_timeout=0.5, max_restarts=1, grace_period=0.5)(
        workers.beat_then_fall_silent
    )
    with pytest.warns(RuntimeWarning, match="attempt 1 of 2 failed"), pytest.raises(StallError) as caught:
        run(0, 2, 0.05)
    assert caught.value.rank == 0
    assert len(caught.value.earlier_attempts) == 1  # type: ignore[attr-defined]


def test_future_stacks_while_it_runs(tmp_path: Path) -> None:
    ready = str(tmp_path / "ready")
    future = parallel(nprocs=2, start_method="fork", timeout=60)(workers.waiting_here).submit(ready, 60)
    try:
        _wait_for([f"{ready}.0", f"{ready}.1"])
        start = time.monotonic()
        stacks = future.stacks()
        assert time.monotonic() - start < 1.5
        assert set(stacks) == {0, 1}
        assert all("waiting_here" in text for text in stacks.values())
        assert future.running()
        assert "waiting_here" in future.stacks()[1]  # again: the files start over
    finally:
        assert future.cancel()
    assert future.stacks() == {}


RESTARTED_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from mplaunch import parallel
    from tests import workers

    if __name__ == "__main__":
        directory = sys.argv[1]
        os.register_at_fork(after_in_child=lambda: workers.hold_restarted_forks(directory))
        run = parallel(nprocs=1, start_method="fork", timeout=60, max_restarts=1)(workers.fail_first_attempt)
        future = run.submit(directory)
        control = future._control
        while not (os.path.exists(os.path.join(directory, "held")) and control.restarts == 1):
            time.sleep(0.01)
        while control.stacks_source is None:  # the second attempt's worker is started, and held
            time.sleep(0.01)
        print("STACKS", future.stacks())
        open(os.path.join(directory, "go"), "w").close()
        try:
            print("RESULT", future.result(60))
        except Exception as error:
            print("FAILED", error)
    """
)


@pytest.mark.skipif(STACKS_SIGNAL is None, reason="no real-time signals")
def test_stacks_asked_while_a_restarted_worker_starts_do_not_end_it(tmp_path: Path) -> None:
    """The first attempt's dump file stayed in the launch directory: the restarted worker was signalled
    before it could dump, and died by the signal."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", RESTARTED_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).parents[2]),
    )
    assert "STACKS {}" in result.stdout, result.stdout + result.stderr
    assert "RESULT second attempt" in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(STACKS_SIGNAL is None or not os.path.exists("/proc/self/status"), reason="Linux")
def test_only_launches_that_may_ask_for_stacks_install_the_dump_handler(tmp_path: Path) -> None:
    """A plain call without a timeout never asks for stacks, so its ranks do not pay for the handler (issue 26),
    and its report still has each rank's usage; a timeout, a stall_timeout or a future does ask."""
    signum = int(STACKS_SIGNAL or 0)
    plain = parallel(nprocs=2, start_method="fork", return_all=True)(workers.catches)
    assert plain(signum) == [False, False]
    report = plain.last_report
    assert report is not None
    assert all(rank.max_rss and rank.user_time is not None for rank in report.ranks)
    assert plain.options(timeout=60)(signum) == [True, True]
    assert plain.options(stall_timeout=60)(signum) == [True, True]
    ready = str(tmp_path / "ready")
    future = parallel(nprocs=2, start_method="fork")(workers.waiting_here).submit(ready, 60)  # no timeout
    try:
        _wait_for([f"{ready}.0", f"{ready}.1"])
        assert all("waiting_here" in text for text in future.stacks().values())
        assert set(future.stacks()) == {0, 1}
    finally:
        assert future.cancel()


@pytest.mark.skipif(STACKS_SIGNAL is None or not os.path.exists("/proc/self/status"), reason="Linux")
def test_a_process_a_rank_forks_has_no_dump_handler() -> None:
    """A process the rank forks (a DataLoader worker) is not the rank: it drops the dump handler it inherits,
    also in a launch without a board (a timeout, no stall_timeout)."""
    signum = int(STACKS_SIGNAL or 0)
    run = parallel(nprocs=1, start_method="fork", timeout=60)(workers.forked_child_catches)
    assert run.options(stall_timeout=60)(signum) is False
    assert run(signum) is False


def test_report_after_a_call() -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=60)(workers.sleep)
    assert run.last_report is None
    run(0.2)
    report = run.last_report
    assert report is not None
    assert [r.exitcode for r in report.ranks] == [0, 0]
    for rank in report.ranks:
        assert rank.max_rss is not None
        assert rank.max_rss > 10 * 2**20
        assert rank.user_time is not None
        assert rank.wall_time is not None
        assert rank.wall_time >= 0.2
        assert rank.oom is False
        assert rank.signal_name is None
    assert report.wall_time >= 0.2
    assert report.restarts == 0


def test_a_rank_the_launch_stopped_says_so_in_the_report() -> None:
    """A rank stopped after another failed read 'exit 143' in the report, with nothing saying that the
    launch stopped it (a new user's report); the rank that failed is not marked."""
    run = parallel(nprocs=2, start_method="fork", timeout=60, grace_period=5.0)(workers.raise_value_error)
    with pytest.raises(ValueError) as caught:
        run("bad")
    report = caught.value.report  # type: ignore[attr-defined]
    assert [(r.rank, r.stopped) for r in report.ranks] == [(0, True), (1, False)], report
    assert "(stopped by the launch)" in str(report).splitlines()[1]
    assert "stopped" not in str(report).splitlines()[2]


def test_a_rank_the_stop_killed_after_it_returned_says_so_in_the_report(tmp_path: Path) -> None:
    """Rank 0 returned, then lingered in an exit handler until the launch (stopping it after rank 1 failed)
    killed it: its line read a bare 'SIGKILL', as if killed by someone else (found by a break-it pass)."""
    run = parallel(nprocs=2, start_method="fork", timeout=60, grace_period=1.0)(workers.rank0_returns_then_lingers)
    with pytest.raises(KeyError) as caught:
        run(str(tmp_path))
    rank0 = caught.value.report.ranks[0]  # type: ignore[attr-defined]
    assert rank0.stopped, rank0
    assert "(stopped by the launch)" in str(caught.value.report).splitlines()[1]  # type: ignore[attr-defined]


def test_a_ranks_wall_time_counts_from_its_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent notes each rank's start after its last fork: rank 0's wall time missed the time it ran
    meanwhile (a CI run read 0.1976 s for a 0.2 s rank). A slow second fork makes that certain."""
    run = parallel(nprocs=2, start_method="fork", timeout=60)(workers.sleep)
    fork_with(monkeypatch, lambda forked: time.sleep(0.3) if forked else None)  # a slow second fork
    run(0.2)
    monkeypatch.undo()
    assert run.last_report is not None
    assert all(r.wall_time is not None and r.wall_time >= 0.2 for r in run.last_report.ranks), run.last_report


def test_report_of_a_forkserver_launch_comes_from_the_workers() -> None:
    future = parallel(nprocs=2, start_method="forkserver", timeout=90)(workers.sleep).submit(0.1)
    assert future.result() == 0
    report = future.report
    assert report is not None
    assert all(r.max_rss and r.exitcode == 0 for r in report.ranks)


@pytest.mark.slow
def test_report_of_a_spawn_launch_keeps_the_usage_when_multiprocessing_reaps_first() -> None:
    """A spawn worker is ``multiprocessing``'s child: another thread that starts a process (or calls
    ``active_children()``) reaped it before the launch now and then, and its exit code and the kernel's account
    of it were lost (without ``stall_timeout`` the launch made no board, where the worker leaves its own). The
    launch takes its workers off ``multiprocessing``'s list, as it does forked ones."""
    done = threading.Event()

    def reap_children() -> None:
        while not done.is_set():
            multiprocessing.active_children()

    thread = threading.Thread(target=reap_children)
    thread.start()
    try:
        future = parallel(nprocs=1, start_method="spawn", timeout=120)(workers.sleep).submit(0.1)
        assert future.result() == 0
    finally:
        done.set()
        thread.join()
    report = future.report
    assert report is not None
    assert all(r.max_rss and r.user_time is not None and r.exitcode == 0 for r in report.ranks), report


def test_report_of_a_fork_launch_keeps_the_usage_when_the_callers_sigchld_handler_reaps_first() -> None:
    """A caller's SIGCHLD handler that reaps every child (a common server pattern) reaps forked workers before
    the launch can read the kernel's account of them: the report had no peak memory or CPU time. A fork launch
    whose caller handles SIGCHLD has the workers leave their own usage, as other start methods do."""
    run = parallel(nprocs=2, start_method="fork", timeout=60)(workers.sleep)
    with reaping_sigchld_handler():
        assert run(0.1) == 0
    report = run.last_report
    assert report is not None
    assert all(r.max_rss and r.user_time is not None for r in report.ranks), report


@pytest.mark.skipif(not kernel_keeps_reaped_status(), reason="needs PIDFD_INFO_EXIT (Linux 6.15+)")
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_callers_reaping_sigchld_handler_leaves_each_ranks_exit_known(start_method: StartMethod) -> None:
    """A caller's SIGCHLD handler that reaps every child took the workers' exit statuses: a SIGKILLed rank
    "exited with code None", and every report line read "exit None" (found by a break-it pass)."""
    run = parallel(nprocs=2, start_method=start_method, timeout=120)(workers.kill_self)
    with reaping_sigchld_handler():
        with pytest.raises(WorkerExitedError) as caught:
            run(signal.SIGKILL)
        assert "was ended by SIGKILL (signal 9)" in str(caught.value), str(caught.value)
        assert caught.value.exitcode == -signal.SIGKILL
        exiting = parallel(nprocs=2, start_method=start_method, timeout=120)(workers.os_exit_on_rank)
        with pytest.raises(WorkerExitedError, match="exited with code 7 before returning") as exited:
            exiting(1, 7)
    assert exited.value.report is not None
    codes = [r.exitcode for r in exited.value.report.ranks]
    assert codes[1] == 7 and codes[0] is not None, exited.value.report  # rank 0 returned, or was stopped


def test_an_exit_status_taken_by_someone_else_is_named_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel keeps no status for a reaped process, the message says what happened to it, not
    "exited with code None"."""
    monkeypatch.setattr(report_module, "reaped_status", lambda pidfd: None)
    run = parallel(nprocs=2, start_method="fork", timeout=60)(workers.os_exit_on_rank)
    with reaping_sigchld_handler(), pytest.raises(WorkerExitedError) as caught:
        run(1, 7)
    assert "rank 1" in str(caught.value)
    assert "its exit status is unknown: something else in this process reaped it first" in str(caught.value)
    assert caught.value.exitcode is None


def test_kill_9_is_not_the_oom_killer() -> None:
    with pytest.raises(WorkerExitedError) as caught:
        parallel(nprocs=2, start_method="fork", timeout=60)(workers.kill_self)(signal.SIGKILL)
    error = caught.value
    known = bool(oom_counters(os.getpid()))
    assert error.oom is (False if known else None)
    assert "killed by the out-of-memory killer" not in str(error)
    assert error.report is not None
    assert error.report.ranks[1].oom is error.oom
    assert pickle.loads(pickle.dumps(error)).oom is error.oom


def _memory_cgroup(tmp_name: str) -> tuple[Path, str] | None:
    """A new child of this process's memory cgroup (v1 or v2) that the test may limit, else ``None``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        elif controllers == "":
            base, limit = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
            if "memory" not in (base / "cgroup.subtree_control").read_text() if base.exists() else "":
                continue
        else:
            continue
        try:
            (base / tmp_name).mkdir()
        except OSError:
            continue
        return base / tmp_name, limit
    return None


OOM_SCRIPT = textwrap.dedent(
    """
    from mplaunch import WorkerExitedError, parallel
    from tests import workers

    if __name__ == "__main__":
        try:
            parallel(nprocs=2, start_method="fork", timeout=60, grace_period=1)(workers.allocate_until_killed)(1)
        except WorkerExitedError as error:
            print("OOM", error.rank, error.oom, error.report.ranks[1].oom, "|", error)
    """
)


@pytest.mark.slow
def test_oom_under_a_memory_limit_is_named() -> None:
    found = _memory_cgroup(f"mplaunch-test-{os.getpid()}")
    if found is None:
        pytest.skip("no memory cgroup this test may create and limit (needs cgroup v1 or a delegated v2 tree)")
    group, limit = found
    try:
        (group / limit).write_text(str(1536 * 2**20))
        procs = str(group / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as file:
                file.write(str(os.getpid()))

        result = subprocess.run(
            [sys.executable, "-c", OOM_SCRIPT],
            preexec_fn=enter,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(Path(__file__).parents[2]),
        )
        line = next((line for line in result.stdout.splitlines() if line.startswith("OOM ")), None)
        assert line is not None, result.stdout + result.stderr
        assert line.startswith("OOM 1 True True |")
        assert "killed by the out-of-memory killer" in line
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_rank_that_cannot_dump_delays_the_stop_by_the_bound_at_most(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=3.0, grace_period=0.5)(workers.rank1_frozen)
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        run(str(tmp_path / "ready"))
    assert time.monotonic() - start < 3.0 + 1.0 + 0.5 + 1.5  # timeout + the dump's bound + grace + slack
    assert set(caught.value.stacks) == {0}
    assert "stuck_here" in caught.value.stacks[0]
    assert "Ranks [1] sent no stacks" in str(caught.value)


def test_a_timeout_of_a_month_is_a_timeout_not_an_overflow() -> None:
    """``timeout=30 * 86400`` failed with ``OverflowError: timeout is too large`` (poll takes at most 24.8
    days), in a call, a submitted launch, warm workers, and a stall_timeout or grace_period as long."""
    from mplaunch import Workers

    month = 30 * 86400.0
    run = parallel(nprocs=2, start_method="fork", timeout=month, grace_period=month)(workers.sleep)
    assert run(0.0) == 0
    assert run.options(stall_timeout=month)(0.0) == 0
    assert run.submit(0.0).result(timeout=60) == 0
    with Workers(nprocs=2, start_method="fork", timeout=month, grace_period=month) as warm:
        assert warm.run(workers.sleep, 0.0) == 0
