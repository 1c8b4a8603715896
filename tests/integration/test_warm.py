"""Warm workers (issue 24): mplaunch.Workers keeps its ranks and their state between calls, and leaves nothing
behind however it ends."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import mplaunch
from mplaunch import LaunchTimeoutError, StartMethod, WorkerExitedError, Workers, parallel
from mplaunch._parent import directory as launch_dir
from tests import warm_workers

TIMEOUT = 90


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of another parent is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_global_set_in_one_run_is_read_in_the_next_by_the_same_processes(start_method: StartMethod) -> None:
    with Workers(nprocs=2, start_method=start_method, timeout=TIMEOUT, return_all=True) as workers:
        first = workers.run(warm_workers.bump)
        second = workers.run(warm_workers.bump)
    assert [value[2] for value in first] == [1, 1]
    assert [value[2] for value in second] == [2, 2]
    assert [value[:2] for value in first] == [value[:2] for value in second]
    assert [rank for rank, _, _ in first] == [0, 1]


def test_bad_calls_and_options_are_refused_before_the_ranks_see_them() -> None:
    """run(5) failed with a bare "TypeError: 'int' object is not callable"; wrong arguments failed in every
    rank; console_ranks naming no rank silently dropped every line. Each is now refused in the caller, as a
    launch refuses them, and the ranks stay usable."""
    with pytest.raises(mplaunch.InvalidOptionError, match=r"console_ranks=\[3\] names no rank.*below 2"):
        Workers(nprocs=2, start_method="fork", console_ranks=[3])
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as warm:
        for call in (warm.run, warm.submit):
            with pytest.raises(TypeError, match=r"not 5: pass a function, then its arguments"):
                call(5)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"rank_and_pid\(\): too many positional arguments.*sending the call"):
                call(warm_workers.rank_and_pid, 1)
        assert warm.run(warm_workers.rank_and_pid)[0] == 0


def test_a_decorated_function_runs_its_plain_function_and_rank_0s_value_is_returned() -> None:
    decorated = parallel(nprocs=2)(warm_workers.rank_and_pid)
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        rank, pid = workers.run(decorated)
        assert rank == 0
        assert pid == workers.pids[0]


def test_a_function_defined_after_the_start_reaches_the_ranks_by_value() -> None:
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, return_all=True) as workers:
        offset = 7

        def later(x: int) -> int:  # a closure the forked ranks never had
            return mplaunch.worker_info().rank + x + offset

        assert workers.run(later, 1) == [8, 9]


def test_a_submitted_calls_future_gives_the_ranks_stacks_while_it_runs(tmp_path: Path) -> None:
    """future.stacks() of a warm call was always {} while the ranks ran it (found by a break-it pass)."""
    from tests import workers

    ready = str(tmp_path / "ready")
    with Workers(nprocs=2, start_method="fork", timeout=60) as warm:
        future = warm.submit(workers.waiting_here, ready, 2.0)
        deadline = time.monotonic() + 30
        while not all(os.path.exists(f"{ready}.{rank}") for rank in (0, 1)):
            assert time.monotonic() < deadline, "the ranks did not start the call"
            time.sleep(0.01)
        found = future.stacks()
        assert sorted(found) == [0, 1], found
        assert all("waiting_here" in text for text in found.values()), found
        assert future.result(timeout=60) == 0
        assert future.stacks() == {}  # the call has ended: no rank runs it


def test_nothing_is_left_after_close() -> None:
    launch_dir._ensure_reaper(launch_dir.shm_root())  # the process's reaper (and its pipe) stays: not the workers'
    fds = _fds()
    workers = Workers(nprocs=2, start_method="fork", timeout=TIMEOUT)
    pids = workers.pids
    directory = workers._held.team.ranks.spec.directory  # type: ignore[union-attr]
    workers.run(warm_workers.bump)
    workers.close()
    workers.close()  # idempotent
    assert _gone(pids, 0.1)
    assert not os.path.exists(directory)
    assert _fds() <= fds
    with pytest.raises(RuntimeError, match="closed"):
        workers.run(warm_workers.bump)


def test_nothing_is_left_after_garbage_collection() -> None:
    workers = Workers(nprocs=2, start_method="fork", timeout=TIMEOUT)
    pids = workers.pids
    directory = workers._held.team.ranks.spec.directory  # type: ignore[union-attr]
    del workers
    gc.collect()
    assert _gone(pids, 0.1)
    assert not os.path.exists(directory)


_SCRIPT = """
import sys
from mplaunch import Workers
from tests import warm_workers

if __name__ == "__main__":
    workers = Workers(nprocs=2, start_method=sys.argv[1], timeout=90)
    workers.run(warm_workers.bump)
    print(*workers.pids, workers._held.team.ranks.spec.directory, flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_nothing_is_left_after_the_parent_is_killed(start_method: str, tmp_path: Path) -> None:
    script = tmp_path / "warm.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    parent = subprocess.Popen(
        [sys.executable, str(script), start_method], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert parent.stdout is not None
        *pids, directory = parent.stdout.readline().split()
        assert len(pids) == 2
        assert os.path.isdir(directory)
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdin is not None
        parent.stdin.close()
        assert parent.stdout is not None
        parent.stdout.close()
    assert _gone([int(pid) for pid in pids])
    deadline = time.monotonic() + 10
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(directory)


def test_a_failure_raises_as_itself_and_keeps_the_ranks() -> None:
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        pids = workers.pids
        with pytest.raises(ValueError, match="rank 1 fails") as caught:
            workers.run(warm_workers.raise_in_rank, 1)
        assert caught.value.rank == 1  # type: ignore[attr-defined]
        assert caught.value.pid == pids[1]  # type: ignore[attr-defined]
        workers.run(warm_workers.bump)
        assert workers.pids == pids


def test_a_dead_rank_is_started_again_by_the_next_run_with_a_warning() -> None:
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=2.0) as workers:
        workers.run(warm_workers.bump)
        pids = workers.pids
        with pytest.raises(WorkerExitedError) as caught:
            workers.run(warm_workers.exit_in_rank, 1, 3)
        assert caught.value.rank == 1
        assert caught.value.exitcode == 3
        assert _gone(pids)
        with pytest.warns(RuntimeWarning, match="state they held"):
            _, pid, count = workers.run(warm_workers.bump)
        assert count == 1
        assert pid not in pids


def test_ctrl_c_stops_the_call_not_the_workers(tmp_path: Path) -> None:
    started = str(tmp_path / "started")

    def interrupt_when_started() -> None:
        while not (os.path.exists(f"{started}0") and os.path.exists(f"{started}1")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, return_all=True) as workers:
        workers.run(warm_workers.bump)
        pids = workers.pids
        thread = threading.Thread(target=interrupt_when_started)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            workers.run(warm_workers.sleep_forever, started)
        thread.join()
        assert [count for _, _, count in workers.run(warm_workers.bump)] == [2, 2]
        assert workers.pids == pids


def test_a_call_past_its_timeout_is_interrupted_and_the_ranks_kept(tmp_path: Path) -> None:
    with Workers(nprocs=2, start_method="fork", timeout=1.0) as workers:
        pids = workers.pids
        with pytest.raises(LaunchTimeoutError):
            workers.run(warm_workers.wait_for, str(tmp_path / "never"))
        workers.run(warm_workers.bump)
        assert workers.pids == pids


def test_submit_returns_a_future_and_calls_run_one_at_a_time(tmp_path: Path) -> None:
    path, started = str(tmp_path / "go"), str(tmp_path / "started")
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        waiting = workers.submit(warm_workers.wait_for, path, started)
        while not os.path.exists(started):
            time.sleep(0.01)
        after = workers.submit(warm_workers.bump)
        assert not waiting.done()
        assert not after.done()
        Path(path).touch()
        assert waiting.result(TIMEOUT) == "seen"
        assert after.result(TIMEOUT)[2] == 1


def test_calls_reach_every_rank_in_the_order_they_were_made(tmp_path: Path) -> None:
    """A first-in, first-out queue (a one-thread executor's, Ray's actor calls from one caller): 20 calls
    submitted while one runs, a ``run()`` from the main thread between them, and a queued call cancelled.
    They were reordered: each waited for a plain lock in its thread of its own (``...10, 12, 13, 11...``)."""
    go, started = str(tmp_path / "go"), str(tmp_path / "started")
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, return_all=True) as workers:
        first = workers.submit(warm_workers.wait_for, go, started)
        while not os.path.exists(started):
            time.sleep(0.01)
        queued = [workers.submit(warm_workers.record, index) for index in range(10)]
        assert queued[3].cancel()
        Path(go).touch()
        between = workers.run(warm_workers.record, "run")
        later = [workers.submit(warm_workers.record, index) for index in range(10, 20)]
        orders = later[-1].result(TIMEOUT)
    assert first.result() == ["seen", "seen"]
    assert queued[3].cancelled()
    expected = [*(index for index in range(10) if index != 3), "run", *range(10, 20)]
    assert between == [expected[:10], expected[:10]]
    assert orders == [expected, expected]


def test_options_that_warm_workers_cannot_honour_are_refused() -> None:
    with pytest.raises(mplaunch.InvalidOptionError, match="max_restarts"):
        Workers(nprocs=2, start_method="fork", max_restarts=1)
    with pytest.raises(mplaunch.InvalidOptionError, match="nprocs"):
        Workers(nprocs=0)


def test_a_calls_output_is_written_before_it_returns(capsys: pytest.CaptureFixture[str]) -> None:
    """The ranks' pipes outlive the call: their text is flushed and written out before run() returns, to the
    caller's sys.stdout of this call (a notebook cell's)."""
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, prefix_output=True) as workers:
        workers.run(warm_workers.say, "first")
        first = capsys.readouterr().out
        workers.run(warm_workers.say, "second")
        second = capsys.readouterr().out
    assert "[rank 0] first from rank 0" in first, first
    assert "[rank 1] first from rank 1" in first, first
    assert "second from rank 0" in second, second
    assert "second from rank 1" in second, second


def test_the_process_group_is_made_once_and_kept() -> None:
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, backend="gloo") as workers:
        first = workers.run(warm_workers.all_reduce_once)
        second = workers.run(warm_workers.all_reduce_once)
    assert first == second
    assert first[0] == 3


def test_cancelling_a_submitted_call_interrupts_it_and_keeps_the_ranks(tmp_path: Path) -> None:
    started = str(tmp_path / "started")
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        pids = workers.pids
        future = workers.submit(warm_workers.sleep_forever, started)
        while not (os.path.exists(f"{started}0") and os.path.exists(f"{started}1")):
            time.sleep(0.01)
        assert future.cancel()
        assert future.cancelled()
        assert workers.run(warm_workers.bump)[2] == 1
        assert workers.pids == pids


def test_closing_while_a_call_runs_in_another_thread_stops_it(tmp_path: Path) -> None:
    started = str(tmp_path / "started")
    workers = Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=1.0)
    pids = workers.pids
    future = workers.submit(warm_workers.sleep_forever, started)
    while not (os.path.exists(f"{started}0") and os.path.exists(f"{started}1")):
        time.sleep(0.01)
    workers.close()
    with pytest.raises(RuntimeError, match="closed while this call ran"):
        future.result(TIMEOUT)
    assert _gone(pids, 0.1)


def test_options_that_place_the_ranks_apply_and_restarts_are_refused_naming_workers() -> None:
    """env=, devices=, cpu_binding= and stall_timeout were refused with "it applies to launches (@parallel)
    only"; they now apply to warm ranks. A restart cannot re-run a call whose state died with its ranks."""
    with pytest.raises(mplaunch.InvalidOptionError, match=r"max_restarts=1 is not valid for Workers\(\.\.\.\)"):
        Workers(nprocs=2, start_method="fork", max_restarts=1)
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT, env={"MPLAUNCH_TEST_VAR": "7"}) as workers:
        assert workers.run(os.getenv, "MPLAUNCH_TEST_VAR") == "7"


def test_a_warm_result_that_exits_when_unpickled_is_a_remote_error_and_the_ranks_stay() -> None:
    """The kind of issue 21's exit-order bug, on warm workers: a result whose unpickling raises SystemExit in
    the parent is the documented RemoteError, never a bare SystemExit, and the ranks keep running."""
    from mplaunch import RemoteError
    from tests import compat_workers

    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT) as workers:
        before = workers.pids
        with pytest.raises(RemoteError, match=r"cannot be unpickled in the parent: SystemExit: 4"):
            workers.run(compat_workers.result_exiting_when_unpickled)
        assert workers.run(os.getpid) == before[0]


_LATE = """
import sys
from mplaunch import Workers, parallel

if __name__ == "__main__":
    method = sys.argv[1]
    with Workers(nprocs=2, start_method=method, timeout=90, return_all=True) as workers:
        # defined after the ranks started, in __main__ but not by the script: a worker's __main__ lacks it
        exec("def late_fn(x):\\n    import mplaunch\\n    return mplaunch.worker_info().rank + x\\n", globals())
        print("warm", workers.run(late_fn, 10), flush=True)
    print("launch", parallel(nprocs=2, start_method=method, return_all=True, timeout=90)(late_fn)(20), flush=True)
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_function_defined_after_the_ranks_started_runs_in_them(start_method: str, tmp_path: Path) -> None:
    """It travelled by reference, and spawn and forkserver ranks failed with "Can't get attribute 'late_fn'
    on <module '__mp_main__'>"; now what the worker's re-run of the script does not define travels by value,
    in a warm call and in a launch."""
    from tests.helpers import run_script, write_script

    done = run_script(write_script(tmp_path, _LATE), start_method)
    assert done.returncode == 0, done.stderr
    assert "warm [10, 11]" in done.stdout
    assert "launch [20, 21]" in done.stdout


def test_a_stream_refused_as_it_starts_raises_its_refusal_and_frees_the_workers() -> None:
    """A generator's call on warm workers that failed as it started (its first step) released the call lock
    twice: the caller got "RuntimeError: release unlocked lock" instead of the refusal, and the workers were
    left unusable."""
    import signal

    found: list[BaseException] = []
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT, preempt_signals=(signal.SIGUSR1,)) as warm:

        def in_a_thread() -> None:  # no signal handler can run there: preempt_signals is refused
            try:
                list(warm.run(warm_workers.ranked_values, 2))
            except BaseException as error:  # noqa: BLE001 - checked below
                found.append(error)

        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join(TIMEOUT)
        assert [type(error) for error in found] == [mplaunch.InvalidOptionError], found
        assert list(warm.run(warm_workers.ranked_values, 2)) == [0, 1]  # the lock is free again


def _marks(directory: Path, count: int) -> list[str]:
    deadline = time.monotonic() + TIMEOUT
    while len(names := sorted(path.name for path in directory.iterdir())) < count:
        assert time.monotonic() < deadline, names
        time.sleep(0.02)
    return names


CLEANED_UP = ["atexit0", "atexit1", "finally0", "finally1", "started0", "started1"]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_close_while_a_submitted_call_runs_lets_the_ranks_clean_up(tmp_path: Path, start_method: StartMethod) -> None:
    """Issue 37, item 5: ``close()`` while a call runs in another thread: every rank's ``finally`` block and exit
    handlers run, well within ``grace_period``, before the ranks end."""
    workers = Workers(nprocs=2, start_method=start_method, timeout=TIMEOUT, grace_period=5.0)
    future = workers.submit(warm_workers.hold_with_clean_up, str(tmp_path))
    _marks(tmp_path, 2)
    pids = workers.pids
    started = time.monotonic()
    workers.close()
    assert time.monotonic() - started < 5.0
    with pytest.raises(RuntimeError, match="closed while this call ran"):
        future.result(TIMEOUT)
    assert sorted(path.name for path in tmp_path.iterdir()) == CLEANED_UP
    assert _gone(pids, 0.1)


def test_close_from_another_thread_kills_a_rank_whose_clean_up_hangs_after_grace_period(tmp_path: Path) -> None:
    """``close()`` from another thread while ``run()`` runs: the ranks' ``finally`` blocks run; one that never
    ends is killed after ``grace_period`` (its exit handlers cannot run), and ``run()`` says why it ended."""
    workers = Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=1.0)
    pids = workers.pids
    took: list[float] = []

    def close() -> None:
        _marks(tmp_path, 2)
        started = time.monotonic()
        workers.close()
        took.append(time.monotonic() - started)

    closer = threading.Thread(target=close)
    closer.start()
    with pytest.raises(RuntimeError, match="closed while this call ran"):
        workers.run(warm_workers.hold_with_clean_up, str(tmp_path), True)
    closer.join()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["finally0", "finally1", "started0", "started1"]
    assert 1.0 <= took[0] < 6.0, took
    assert _gone(pids, 0.1)


AT_EXIT = """
import os, sys, threading, time
from mplaunch import Workers, parallel
from tests import warm_workers

if __name__ == "__main__":
    how, start_method, marks = sys.argv[1:]
    options = dict(nprocs=2, start_method=start_method, timeout=90, grace_period=5.0)
    if how == "Workers.run":
        stream = Workers(**options).run(warm_workers.stream_with_clean_up, marks)
    elif how == "Workers.submit":
        stream = Workers(**options).submit(warm_workers.stream_with_clean_up, marks).items
    elif how == "submit":
        stream = parallel(**options)(warm_workers.stream_with_clean_up).submit(marks).items
    else:
        stream = parallel(**options)(warm_workers.stream_with_clean_up)(marks)
    if how != "unread call":  # (an unread one is left open, not collected: the script holds it)
        threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
    while len(os.listdir(marks)) < 2:
        time.sleep(0.02)
    print("leaving", flush=True)
"""


@pytest.mark.parametrize(
    ("how", "start_method"),
    [
        ("Workers.run", "fork"),
        ("Workers.run", "spawn"),
        ("Workers.submit", "fork"),
        ("call", "fork"),
        ("call", "spawn"),
        ("unread call", "fork"),
        ("submit", "fork"),
    ],
)
def test_the_end_of_a_program_with_a_stream_read_in_a_thread_lets_the_ranks_clean_up(
    tmp_path: Path, how: str, start_method: str
) -> None:
    """Issue 37, item 5: the program ends while a daemon thread still reads a stream (of warm workers, of a
    launch, of a submitted one), or with a launch's stream left unread: the ranks' ``finally`` blocks and exit
    handlers run, and nothing is left. A launch's stream was killed with the parent, its ranks' cleanup unrun."""
    script, marks = tmp_path / "script.py", tmp_path / "marks"
    script.write_text(textwrap.dedent(AT_EXIT))
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), how, start_method, str(marks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in marks.iterdir()) == CLEANED_UP, done.stderr
    assert "Exception" not in done.stderr and "Traceback" not in done.stderr, done.stderr  # the reader ends quietly
    assert time.monotonic() - started < 60
    assert _gone([int((marks / f"started{rank}").read_text()) for rank in (0, 1)], 1.0)
