"""Failures, exactly (issue 16): stops are states, signals are named, children never hold the call, exit codes
are CPython's. Races are repeated in one loop of launches, not run once."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mplaunch import InvalidOptionError, LaunchTimeoutError, StartMethod, WorkerExitedError, parallel
from mplaunch._worker import entry
from tests import workers
from tests.helpers import fork_with, gone

TIMEOUT = 90
METHODS = ["fork", "forkserver", "spawn"]


def launch(function: Callable[..., Any], start_method: StartMethod = "fork", **options: object) -> Callable[..., Any]:
    options = {"nprocs": 2, "start_method": start_method, "timeout": TIMEOUT, **options}
    run: Callable[..., Any] = parallel(**options)(function)  # type: ignore[call-overload]
    return run


@pytest.mark.parametrize("slowed", ["reaping", "waking"])
def test_a_rank_killed_by_a_signal_comes_before_its_peers_later_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, slowed: str
) -> None:
    """A rank killed by SIGKILL was timed once the parent had reaped it and read what it left, milliseconds
    after its end was seen; a peer's collective failing of its death in between seemed the first failure and
    was raised (gloo's "Connection closed by peer", the SIGKILL only in `failures`). On a busy machine the
    peer also raised before the parent woke to the death at all. A death by SIGKILL, never a peer's
    consequence, now counts from when its end was seen, less NOTICE_SLACK. Here either the reaping is slowed
    to 0.6 s (the peer fails 0.2 s after the death), or the parent wakes 0.05 s late (the peer fails at once)."""
    from mplaunch._parent.usage import RankRecords
    from mplaunch._platform.ready import readable

    if slowed == "reaping":
        reap = RankRecords.reap

        def slow_reap(self: RankRecords, rank: int, process: Any, pidfd: int | None = None) -> None:
            if rank == 1:
                time.sleep(0.6)
            reap(self, rank, process, pidfd)

        monkeypatch.setattr(RankRecords, "reap", slow_reap)
    else:

        def late(fds: list[int], timeout: float | None) -> list[int]:
            ready = readable(fds, timeout)
            time.sleep(0.05)  # another process had the core
            return ready

        monkeypatch.setattr("mplaunch._parent.ranks.readable", late)
    with pytest.raises(WorkerExitedError, match="SIGKILL") as caught:
        launch(workers.killed_then_peer_fails)(str(tmp_path), 0.2 if slowed == "reaping" else 0.0)
    assert caught.value.rank == 1
    assert [type(failure) for failure in caught.value.failures] == [ValueError]  # type: ignore[attr-defined]


def test_a_warm_rank_killed_by_a_signal_comes_before_its_peers_later_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same in a warm call: the killed rank was timed after it was joined and its outcome looked for."""
    from mplaunch import Workers
    from mplaunch._parent.usage import RankRecords

    reap = RankRecords.reap

    def slow_reap(self: RankRecords, rank: int, process: Any, pidfd: int | None = None) -> None:
        if rank == 1:
            time.sleep(0.6)
        reap(self, rank, process, pidfd)

    monkeypatch.setattr(RankRecords, "reap", slow_reap)
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=2.0) as warm:
        with pytest.raises(WorkerExitedError, match="SIGKILL") as caught:
            warm.run(workers.killed_then_peer_fails, str(tmp_path))
    assert caught.value.rank == 1


def test_a_warm_rank_killed_as_its_peer_fails_is_never_taken_for_one_the_call_interrupted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A warm rank killed by SIGKILL while its peer failed (its collective broke of the death) was reported as
    the peer's error whenever the parent read the peer's answer before it saw the death (4 times in 40 with
    gloo): the dead rank was counted among those the call interrupted, and an interrupted rank's end is no
    failure. Here the parent sees each end 0.05 s late (under NOTICE_SLACK), as a loaded machine wakes it."""
    from mplaunch import Workers

    first_seen: dict[int, float] = {}

    def late(ready: list[Any]) -> list[Any]:
        kept = []
        for item in ready:
            if isinstance(item, int) and os.readlink(f"/proc/self/fd/{item}") == "anon_inode:[pidfd]":
                if time.monotonic() - first_seen.setdefault(item, time.monotonic()) < 0.05:
                    continue
            kept.append(item)
        return kept

    for name in ("mplaunch._parent.ranks.readable", "mplaunch._parent.exchange.wait"):  # (the call's wait, before)
        with contextlib.suppress(ImportError, AttributeError):
            real = __import__("pydoc").locate(name)
            monkeypatch.setattr(name, lambda fds, timeout=None, real=real: late(real(fds, timeout)))
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=2.0) as warm:
        for _ in range(3):
            with pytest.raises(WorkerExitedError, match="SIGKILL") as caught, warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the ranks start again: their state is lost
                warm.run(workers.killed_then_peer_fails, str(tmp_path), 0.0)
            assert caught.value.rank == 1
            (tmp_path / "rank1.pid").unlink()
            first_seen.clear()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_stop_while_a_rank_records_its_error_keeps_the_error(start_method: StartMethod) -> None:
    """A SIGTERM that landed while a rank pickled the error its function raised (a peer's failure stops it)
    cut the pickling short: the error reached the caller as a RemoteError "could not be sent as itself"
    instead of its own type (seen in torch's test_exception_all on a loaded machine). The error came first,
    so it is the rank's outcome, whole."""
    with pytest.raises(workers.StoppedWhilePickled, match="the rank's own error") as caught:
        launch(workers.raise_stopped_while_pickled, start_method, nprocs=1)()
    assert caught.value.rank == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_stopped_while_writing_its_result_is_no_failure(
    start_method: StartMethod, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rank 0 has returned and is pickling (slowly) when rank 1 raises: `failures` held a bogus 'exited with
    code 143' for rank 0, and spawn printed 'Exception ignored in atexit callback ... Terminated'."""
    rounds = 2 if start_method == "spawn" else 6  # rank 1 raises once rank 0 pickles: each round is the race
    for round_ in range(rounds):
        started = str(tmp_path / f"pickling-{round_}")
        with pytest.raises(RuntimeError, match="hello") as caught:
            launch(workers.slow_result_while_rank1_raises, start_method, grace_period=1.0)(2.0, started)
        assert caught.value.failures == ()  # type: ignore[attr-defined]
    err = capfd.readouterr().err
    assert "Terminated" not in err, err
    assert "Exception ignored" not in err, err


def test_every_rank_raising_keeps_only_real_failures() -> None:
    """torch's test_exception_all: the first exception is raised; the others are real ValueErrors, never a
    stop reported as a failure."""
    for _ in range(15):
        with pytest.raises(ValueError, match=r"legitimate exception from process (0|1)") as caught:
            launch(workers.raise_from_every_rank)()
        error: Any = caught.value
        assert str(error) == f"legitimate exception from process {error.rank}"  # the raised one is its rank's
        other = [(type(f), f.rank, str(f)) for f in error.failures]
        assert other in ([], [(ValueError, 1 - error.rank, f"legitimate exception from process {1 - error.rank}")])


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGABRT])
def test_a_signal_from_outside_is_named(start_method: StartMethod, signum: int) -> None:
    """A worker ended by someone else's SIGTERM was 'raised Terminated(143)' with signal_name None."""
    if start_method == "spawn" and signum != signal.SIGTERM:
        pytest.skip("the start method does not change how other signals are read; spawn is slow")
    with pytest.raises(WorkerExitedError) as caught:
        launch(workers.kill_self, start_method)(signum)
    error = caught.value
    name = signal.Signals(signum).name
    assert error.rank == 1
    assert error.signal_name in (name, "SIGIOT")
    assert error.signum == signum
    assert f"signal {int(signum)}" in str(error)
    assert error.failures == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("code", "exitcode"), [(None, 0), (True, 1), (False, 0), (3, 3), (123, 123), ("a message", 1)])
def test_exit_codes_are_cpythons(code: object, exitcode: int) -> None:
    """sys.exit() and sys.exit(None) gave exitcode 1; sys.exit(True) gave True."""
    with pytest.raises(WorkerExitedError) as caught:
        launch(workers.exit_on_rank0)(code)
    assert caught.value.rank == 0
    assert caught.value.exitcode == exitcode
    assert type(caught.value.exitcode) is int


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("action", ["return", "raise"])
def test_children_of_a_finished_worker_never_hold_the_call(
    start_method: StartMethod, action: str, tmp_path: Path
) -> None:
    """A worker that started a 600 s child and returned held the call until the child ended (exit handlers
    join non-daemon children); raising, the failure was reported only then."""
    if start_method == "spawn" and action == "raise":
        pytest.skip("spawn: one case is enough")
    pid_file = tmp_path / "pids"
    start = time.monotonic()
    if action == "return":
        assert launch(workers.forked_child_then, start_method, return_all=True)(action, str(pid_file)) == [0, 1]
    else:
        with pytest.raises(ValueError, match="done with an error"):
            launch(workers.forked_child_then, start_method)(action, str(pid_file))
    assert time.monotonic() - start < 60
    assert gone([int(pid_file.read_text())], within=5.0)


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("action", ["wait", "sigterm"])
def test_a_stopped_worker_ends_with_its_children(start_method: StartMethod, action: str, tmp_path: Path) -> None:
    """torch's test_nested: two non-daemon children from start_processes(join=False); stopped (peer failure)
    or killed by SIGTERM, the worker waited for them in its exit handlers (still alive 10 s later)."""
    pid_file = tmp_path / "pids"
    function = workers.start_children_then if action == "sigterm" else workers.fail_after
    start = time.monotonic()
    if action == "sigterm":
        with pytest.raises(WorkerExitedError, match="SIGTERM"):
            launch(function, start_method, grace_period=5.0)(action, str(pid_file))
    else:
        stopper = parallel(nprocs=1, start_method=start_method, timeout=3.0, grace_period=5.0)
        with pytest.raises(LaunchTimeoutError):
            stopper(workers.start_children_then)("wait", str(pid_file))
    assert time.monotonic() - start < 30
    assert gone([int(pid) for pid in pid_file.read_text().split()], within=1.0)


def test_a_log_dir_that_is_a_file_is_refused_before_launching(tmp_path: Path) -> None:
    """It was found only inside the workers (FileExistsError in every rank)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for log_dir in (not_a_dir, not_a_dir / "below"):
        with pytest.raises(InvalidOptionError, match=r"log_dir=.*(is a file|cannot be created)"):
            launch(workers.sleep, log_dir=log_dir)(0.0)
    made = tmp_path / "new" / "logs"
    launch(workers.sleep, log_dir=made)(0.0)
    assert sorted(p.name for p in made.iterdir()) == ["rank0.log", "rank1.log"]


def _raise_by_rank() -> None:
    """Rank 1 raises at once; rank 0 a moment later, as a peer failing in a collective would."""
    if int(os.environ["RANK"]) == 1:
        raise ValueError("the root cause")
    time.sleep(0.5)
    raise RuntimeError("a consequence")


@contextlib.contextmanager
def _slow_teardown(backend: str | None, local_rank: int) -> Iterator[None]:
    """A process group whose teardown takes long in rank 1 (gloo's, waiting on a peer): the launch's stop
    lands there."""
    try:
        yield
    finally:
        if int(os.environ["RANK"]) == 1:
            time.sleep(30)


def test_a_stop_landing_in_the_teardown_after_the_function_raised_keeps_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI finding: rank 1 raised, then tore its process group down slowly; rank 0 failed meanwhile and ended
    first, so the launch stopped rank 1 while it tore down, and rank 1's outcome became "stopped": its error,
    the root cause, was lost and rank 0's consequence raised. An error the function raised before the stop
    came stays its outcome. (Fork: the workers inherit the slow teardown.)"""
    monkeypatch.setattr(entry, "process_group", _slow_teardown)
    started = time.monotonic()
    with pytest.raises(ValueError, match="the root cause") as caught:
        launch(_raise_by_rank, grace_period=10)()
    assert caught.value.rank == 1  # type: ignore[attr-defined]
    assert time.monotonic() - started < 20  # stopped, not waited for


_TEST_PROCESS = os.getpid()


class _SlowToRecord(ValueError):
    """An error whose text takes long to make in a worker (a big tensor in its message, say)."""

    def __str__(self) -> str:
        if os.getpid() != _TEST_PROCESS:
            time.sleep(3)
        return "the root cause, slow to record"


def _raise_slow_to_record() -> None:
    if int(os.environ["RANK"]) == 1:
        raise _SlowToRecord()
    time.sleep(0.5)
    raise RuntimeError("a consequence")


def test_a_stop_landing_while_the_error_is_recorded_keeps_the_error() -> None:
    """CI finding, the same race one step later: the stop landed while rank 1 recorded the error it raised
    (its text, its traceback), and the error was lost to "stopped"."""
    with pytest.raises(_SlowToRecord) as caught:
        launch(_raise_slow_to_record, grace_period=10)()
    assert caught.value.rank == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_root_cause_is_raised_not_a_peers_consequence(start_method: StartMethod) -> None:
    """Rank 1 raised ValueError while rank 0 waited in all_reduce; rank 0 then failed with gloo's 'connection
    closed' and, ending first, was raised: `except ValueError` missed. The first failure in time is raised."""
    for _ in range(3 if start_method == "fork" else 1):
        with pytest.raises(ValueError, match="the root cause") as caught:
            launch(workers.fail_while_peer_in_collective, start_method, backend="gloo")()
        assert caught.value.rank == 1  # type: ignore[attr-defined]
        assert all(f.rank == 0 for f in caught.value.failures)  # type: ignore[attr-defined]


def test_a_ctrl_c_that_another_thread_receives_while_workers_fork_is_delivered_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adversarial finding: the parent blocks SIGINT in its main thread while forking, but the kernel hands a
    process-directed signal to any thread that does not block it (a notebook kernel's, a timer's), and
    Python then ran the handler in the main thread mid-fork, e.g. inside logging's fork hook, where CPython
    prints "Exception ignored" and drops the KeyboardInterrupt. Now it is noted and raised once every worker
    has started, and the launch stops them."""
    import threading

    def ctrl_c_from_a_thread(forked: list[int]) -> None:
        if not forked:
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()  # delivered to the sender thread: the main thread blocks SIGINT here
            time.sleep(0.01)

    started = fork_with(monkeypatch, ctrl_c_from_a_thread)
    with pytest.raises(KeyboardInterrupt):
        launch(workers.sleep)(30)
    assert len(started) == 2  # the signal waited for the last fork
    assert gone(started, within=10)


def test_a_ctrl_c_right_after_a_worker_is_reaped_stays_a_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adversarial finding: a KeyboardInterrupt landing after multiprocessing reaped a worker but before it
    noted the exit code left the worker "running" to multiprocessing, and the clean-up's Process.close()
    raised ValueError instead, skipping the rest of the clean-up. Reproduced here: right after the first
    waitpid that reaps a worker, another thread sends SIGINT and the main thread waits for it."""
    import threading

    reaped: list[int] = []
    waitpid, wait4 = os.waitpid, os.wait4

    def ctrl_c_after(pid: int, result: tuple[Any, ...]) -> None:
        if result[0] == pid and not reaped:
            reaped.append(pid)
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()
            time.sleep(0.01)  # Python runs the handler here, in the main thread

    def waitpid_then_ctrl_c(pid: int, options: int) -> tuple[int, int]:
        result = waitpid(pid, options)
        ctrl_c_after(pid, result)
        return result

    def wait4_then_ctrl_c(pid: int, options: int) -> tuple[int, int, Any]:
        result = wait4(pid, options)
        ctrl_c_after(pid, result)
        return result

    launch(workers.sleep)(0)  # what a first launch opens for good (the reaper's pipe) is open before
    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "waitpid", waitpid_then_ctrl_c)  # what multiprocessing's popen_fork calls
    monkeypatch.setattr(os, "wait4", wait4_then_ctrl_c)  # what the supervisor reaps with (RunReport)
    with pytest.raises(KeyboardInterrupt):
        launch(workers.sleep)(0)
    assert reaped
    assert set(os.listdir("/proc/self/fd")) <= before


def _pids(pid_file: Path) -> list[int]:
    return [int(pid) for rank in (0, 1) for pid in Path(f"{pid_file}{rank}").read_text().split()]


def _all_gone(pids: list[int], within: float) -> bool:
    """Whether every process in ``pids`` has ended (a zombie has) within ``within`` seconds."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            return not alive
        time.sleep(0.05)


@pytest.mark.parametrize("start_method", METHODS)
def test_what_a_rank_started_is_gone_after_the_call(start_method: StartMethod, tmp_path: Path) -> None:
    """A subprocess, an orphan (its parent exited) and a fork child of each rank end with the call: a worker
    stays in the caller's process group, so it stops its tree by walking it (issue 21)."""
    pid_file = tmp_path / "pids"
    assert launch(workers.start_a_tree, start_method, return_all=True, timeout=30)(str(pid_file), "return") == [0, 1]
    assert _all_gone(_pids(pid_file), within=2.0)


@pytest.mark.parametrize("start_method", METHODS)
def test_a_killed_workers_tree_does_not_survive_it(start_method: StartMethod, tmp_path: Path) -> None:
    """Rank 1 ignores SIGTERM, so the launch SIGKILLs it after the grace period: what it started, the orphan
    included, is killed with it, never left to init."""
    pid_file = tmp_path / "pids"
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        launch(workers.start_a_tree, start_method, grace_period=0.5, timeout=30)(str(pid_file), "linger")
    assert _all_gone(_pids(pid_file), within=2.0)


@pytest.mark.parametrize("start_method", METHODS)
def test_what_a_rank_killed_by_someone_else_started_does_not_survive_it(
    start_method: StartMethod, tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed (the out-of-memory killer): it cannot stop its tree, and its subprocesses go to init.
    The parent finds them by the environment the rank gave them, and kills them."""
    pid_file = tmp_path / "pids"
    with pytest.raises(WorkerExitedError) as caught:
        launch(workers.start_a_tree, start_method, timeout=30)(str(pid_file), "die")
    assert caught.value.rank == 1
    assert caught.value.signal_name == "SIGKILL"
    assert _all_gone(_pids(pid_file), within=2.0)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_process_a_worker_forks_has_pythons_own_signal_handlers(start_method: StartMethod) -> None:
    """A process the function forks (a DataLoader worker) ends on SIGTERM and raises KeyboardInterrupt on
    SIGINT, as any Python process: the worker's handlers are not its own."""
    seen = parallel(nprocs=1, start_method=start_method, timeout=120)(workers.handlers_in_a_forked_child)()
    assert seen == f"{signal.SIG_DFL!r} True"
