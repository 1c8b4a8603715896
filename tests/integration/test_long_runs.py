"""Long runs: restarts after a worker failure (max_restarts), launches in the background (submit), and
per-call options. Worker targets live here, at module level, so spawned workers could import them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from mplaunch import InvalidOptionError, LaunchTimeoutError, RestartWarning, parallel, worker_info
from tests.helpers import main_thread_in
from tests.workers import record_and_sleep, yielding

TIMEOUT = 90


def _append(path: str, text: str) -> None:
    with open(path, "a") as file:
        file.write(text + "\n")


def resume_from_checkpoint(directory: str) -> dict[str, Any]:
    """Rank 0 saves a checkpoint, then rank 1 fails on the first attempt; the restart resumes from it."""
    info = worker_info()
    _append(os.path.join(directory, f"attempts-{info.rank}"), str(info.restart_count))
    checkpoint = os.path.join(directory, "checkpoint.pt")
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)  # a process group on each attempt's own store
    if info.restart_count == 0:
        if info.rank == 0:
            torch.save({"step": 7}, checkpoint)
        dist.barrier()
        if info.rank == 1:
            raise ValueError("lost a node")
        time.sleep(30)  # stopped by the restart
    return {
        "step": torch.load(checkpoint)["step"],
        "restart_count": info.restart_count,
        "env": (os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["TORCHELASTIC_MAX_RESTARTS"]),
        "sum": value.item(),
    }


def always_fails(directory: str) -> None:
    info = worker_info()
    _append(os.path.join(directory, f"attempts-{info.rank}"), str(info.restart_count))
    if info.rank == 1:
        raise ValueError(f"attempt {info.restart_count} failed")
    time.sleep(30)


def fail_then_hang(seconds: float) -> None:
    if worker_info().restart_count == 0:
        time.sleep(seconds)
        raise ValueError("first attempt failed")
    time.sleep(60)


def meet(directory: str, mine: str, theirs: str) -> str:
    """Create ``mine`` and wait for ``theirs``: two launches only finish if they run at the same time."""
    if worker_info().rank == 0:
        Path(directory, mine).touch()
        deadline = time.monotonic() + 60
        while not Path(directory, theirs).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{theirs} never appeared: the launches did not run at the same time")
            time.sleep(0.05)
    return mine


def world() -> tuple[int, int]:
    info = worker_info()
    return info.world_size, info.restart_count


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _wait_for_workers(directory: Path, timeout: float = 60) -> None:
    """Wait until both ranks of ``record_and_sleep`` have written their pid."""
    deadline = time.monotonic() + timeout
    while not all((directory / f"pid-{rank}").exists() for rank in range(2)):
        assert time.monotonic() < deadline, f"the workers did not start within {timeout} s"
        time.sleep(0.05)


def _ctrl_c_when(ready: Callable[[], bool]) -> Callable[[], None]:
    """From another thread, send SIGINT to this process as soon as ``ready()`` holds (polled every 10 ms).
    Returns the function that stops the thread (call it in a ``finally``)."""
    stop, armed = threading.Event(), threading.Event()

    def send() -> None:
        armed.wait()  # not while this thread starts it: the SIGINT would land in Thread.start(), outside the test's
        stop.wait(0.1)  # pytest.raises; and a moment for the caller to enter what it waits in
        while not stop.is_set():
            if ready():
                os.kill(os.getpid(), signal.SIGINT)
                return
            stop.wait(0.01)

    sender = threading.Thread(target=send)
    sender.start()
    armed.set()

    def cancel() -> None:
        stop.set()
        sender.join()

    return cancel


def _pids(directory: Path) -> list[int]:
    return [int(line.split()[0]) for rank in range(2) for line in _lines_of(directory / f"pid-{rank}")]


def _lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _gone(pid: int) -> bool:
    """The process has ended (an orphan's zombie, not yet reaped by init, counts as ended)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


# --- restarts -------------------------------------------------------------------------------------------------


def test_restart_resumes_from_a_checkpoint_on_the_second_attempt(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", max_restarts=2, backend="gloo", return_all=True, timeout=TIMEOUT)(
        resume_from_checkpoint
    )
    with pytest.warns(RestartWarning, match=r"attempt 1 of 3 failed \(rank 1 raised ValueError: lost a node\)") as w:
        results = run(str(tmp_path))
    assert len(w) == 1
    assert w[0].filename == __file__  # points at the caller's line, not into mplaunch
    assert [r["step"] for r in results] == [7, 7]
    assert [r["restart_count"] for r in results] == [1, 1]
    assert results[0]["env"] == ("1", "2")
    assert results[0]["sum"] == 3.0
    assert _lines(tmp_path / "attempts-0") == ["0", "1"]
    assert _lines(tmp_path / "attempts-1") == ["0", "1"]


def test_a_submitted_launchs_restart_warning_points_at_the_submitting_line(tmp_path: Path) -> None:
    """It pointed at threading.py, the launch thread's first frame outside mplaunch (a break-it pass)."""
    from tests import workers

    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, max_restarts=1)(workers.fail_first_attempt)
    with pytest.warns(RestartWarning, match="attempt 1 of 2 failed") as w:
        line = sys._getframe().f_lineno + 1
        future = run.submit(str(tmp_path))
        assert future.result(timeout=TIMEOUT) == "second attempt"
    assert [(warning.filename, warning.lineno) for warning in w] == [(__file__, line)]


def test_exhausted_restarts_raise_the_last_failure_with_the_earlier_ones(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", max_restarts=1, timeout=TIMEOUT)(always_fails)
    with pytest.warns(RestartWarning, match="attempt 1 of 2") as w, pytest.raises(ValueError) as caught:
        run(str(tmp_path))
    assert len(w) == 1
    assert str(caught.value) == "attempt 1 failed"
    assert caught.value.rank == 1  # type: ignore[attr-defined]
    (earlier,) = caught.value.earlier_attempts  # type: ignore[attr-defined]
    assert isinstance(earlier, ValueError)
    assert str(earlier) == "attempt 0 failed"
    assert earlier.rank == 1  # type: ignore[attr-defined]
    assert _lines(tmp_path / "attempts-1") == ["0", "1"]


def test_without_max_restarts_nothing_is_restarted(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="attempt 0 failed") as caught:
        parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(always_fails)(str(tmp_path))
    assert caught.value.earlier_attempts == ()  # type: ignore[attr-defined]
    assert _lines(tmp_path / "attempts-1") == ["0"]


def test_timeout_bounds_all_attempts_together() -> None:
    start = time.monotonic()
    run = parallel(nprocs=1, start_method="fork", max_restarts=5, timeout=3.0, grace_period=1)(fail_then_hang)
    with pytest.warns(RestartWarning), pytest.raises(LaunchTimeoutError) as caught:
        run(2.0)  # fails at 2 s; a timeout per attempt would end at 5 s, the launch's ends at 3 s
    assert time.monotonic() - start < 4.7  # a timeout per attempt would end after 5 s
    assert [str(e) for e in caught.value.earlier_attempts] == ["first attempt failed"]  # type: ignore[attr-defined]


def test_a_refusal_before_launching_is_not_retried() -> None:
    run = parallel(nprocs=2, start_method="fork", max_restarts=3)(always_fails)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RestartWarning)
        with pytest.raises(TypeError, match="checked before launching"):
            run()  # type: ignore[call-arg]


def test_ctrl_c_is_never_restarted(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", max_restarts=3, timeout=TIMEOUT)(record_and_sleep)
    cancel = _ctrl_c_when(lambda: all((tmp_path / f"pid-{rank}").exists() for rank in range(2)))
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RestartWarning)
            with pytest.raises(KeyboardInterrupt):
                run(str(tmp_path), 30)
    finally:
        cancel()
    assert time.monotonic() - start < 20
    assert [line.split()[1] for line in _lines_of(tmp_path / "pid-0")] == ["0"]  # one attempt only
    assert all(_gone(pid) for pid in _pids(tmp_path))


# --- submit ---------------------------------------------------------------------------------------------------


def test_submit_returns_at_once_with_the_call_result_or_its_exception(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(record_and_sleep)
    start = time.monotonic()
    future = run.submit(str(tmp_path), 1.0)
    assert time.monotonic() - start < 0.5
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=TIMEOUT) == 2
    assert not future.running()
    failing = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(always_fails).submit(str(tmp_path))
    error = failing.exception(timeout=TIMEOUT)
    assert isinstance(error, ValueError)
    assert error.rank == 1  # type: ignore[attr-defined]
    refused = run.submit(str(tmp_path), 1.0, "extra")  # type: ignore[call-arg]
    assert isinstance(refused.exception(timeout=1), TypeError)  # the same refusal as the call, in the future


def test_cancel_stops_a_running_launch_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=5)(record_and_sleep)
    future = run.submit(str(tmp_path), 300)
    _wait_for_workers(tmp_path)
    assert future.running()
    assert not future.done()
    start = time.monotonic()
    assert future.cancel()
    assert time.monotonic() - start < 5  # within grace_period: the workers end on SIGTERM
    assert future.cancelled()
    assert future.done()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert all(_gone(pid) for pid in _pids(tmp_path))
    assert _lines(tmp_path / "finally-0") == ["ran"]  # stopped with SIGTERM: its finally block ran
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{os.getpid()}-")]
    assert future.cancel()  # already cancelled: still True, as concurrent.futures says


def test_descriptors_are_closed_when_result_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch thread settled the future before it closed the launch's stop pipe: right after result()
    two descriptors were still open now and then (found by a break-it pass; a slow close makes it certain)."""
    from mplaunch._parent.control import LaunchControl
    from tests import workers

    run = parallel(nprocs=1, start_method="fork", timeout=60)(workers.sleep)
    run.submit(0).result()  # what a first launch makes once (the directory reaper)
    close = LaunchControl.close

    def slow_close(self: LaunchControl) -> None:
        time.sleep(0.3)  # a loaded machine
        close(self)

    monkeypatch.setattr(LaunchControl, "close", slow_close)
    before = set(os.listdir("/proc/self/fd"))
    future = run.submit(0)
    assert future.result() == 0
    left = set(os.listdir("/proc/self/fd")) - before
    assert not left, f"descriptors still open when result() returned: {left}"


def test_a_submitted_launchs_error_shows_no_frames_of_the_launch() -> None:
    """A direct call's error shows the caller's line and the worker's traceback; through a future it also
    showed fifteen frames of mplaunch and concurrent.futures (a new user's report)."""
    import traceback

    from mplaunch._parent import futures
    from tests import workers

    future = parallel(nprocs=2, start_method="fork", timeout=60)(workers.raise_value_error).submit("bad")
    with pytest.raises(ValueError, match="bad") as caught:
        future.result()
    files = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert files == [__file__, futures.__file__], files  # this line, then result() (hidden by pytest, IPython)
    assert "raise_value_error" in str(caught.value.__cause__)  # the worker's own traceback
    with pytest.raises(ValueError):
        future.result()  # asked again: the same frames, not more
    again = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert len(again) == 2, again
    other = parallel(nprocs=2, start_method="fork", timeout=60)(workers.raise_value_error).submit("bad")
    error = other.exception()  # what asyncio.wrap_future raises in the awaiting task, too
    assert isinstance(error, ValueError)
    assert traceback.extract_tb(error.__traceback__) == [], traceback.extract_tb(error.__traceback__)


def test_two_submitted_launches_run_at_the_same_time(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(meet)
    first, second = run.submit(str(tmp_path), "a", "b"), run.submit(str(tmp_path), "b", "a")
    done, _ = concurrent.futures.wait([first, second], timeout=TIMEOUT)
    assert len(done) == 2
    assert (first.result(), second.result()) == ("a", "b")


def test_a_launch_started_while_another_starts_its_workers_sees_its_own_end() -> None:
    """A launch whose worker ended waited forever when another launch, submitted from another thread, forked
    while multiprocessing held the worker's sentinel pipe open (the other launch's worker kept its write
    end): the notebook test of submit() hung half of the time. Workers are now started one launch at a
    time; repeated, since it is a race."""
    slow = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=5)(time.sleep)
    quick = slow.options(nprocs=1)
    for _ in range(5):
        later = slow.submit(60)
        assert quick.submit(0).result(timeout=30) is None
        assert later.cancel()


def test_a_launch_is_not_held_by_a_process_forked_while_a_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Second adversarial pass: a process that another thread of the user forked while multiprocessing held a
    worker's sentinel pipe open kept the pipe's write end, and the launch waited until that process exited
    (forever for a long-lived one). Made deterministic here: a helper is forked right after the first
    worker, before multiprocessing closes its copy of that end. The supervisor waits on pidfds now."""
    real_fork, helpers = os.fork, list[int]()

    def fork_then_a_helper() -> int:
        pid = real_fork()
        if pid and not helpers:  # in the parent, after the first worker's fork
            helper = real_fork()
            if helper == 0:  # pragma: no cover - the user's long-lived helper
                time.sleep(60)
                os._exit(0)
            helpers.append(helper)
        return pid

    monkeypatch.setattr(os, "fork", fork_then_a_helper)
    try:
        assert parallel(nprocs=2, start_method="fork", timeout=20)(os.getpid)() != os.getpid()  # timed out when held
    finally:
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@pytest.mark.slow
def test_launches_while_another_thread_keeps_forking() -> None:
    """The same race under load: a thread of the user forks every 2 ms (children living 60 s) during launches.
    With pidfds opened only when the supervisor started waiting, a worker that had ended and been reaped
    (multiprocessing reaps ended children when it starts the next one) could have its pid given to one of
    those children, and the launch waited for that child (1 run in 3). Pidfds are opened as each worker starts."""
    stop, children = threading.Event(), list[int]()

    def fork_helpers() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the user's helper process
                time.sleep(60)
                os._exit(0)
            children.append(pid)
            time.sleep(0.002)

    run = parallel(nprocs=2, start_method="fork", timeout=30)(os.getpid)
    forker = threading.Thread(target=fork_helpers)
    forker.start()
    try:
        for _ in range(10):
            assert run() != os.getpid()  # LaunchTimeoutError when the launch waited for a helper
    finally:
        stop.set()
        forker.join()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_asyncio_awaits_and_cancels_submitted_launches(tmp_path: Path) -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(world)
    sleeper = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(record_and_sleep)
    futures: list[concurrent.futures.Future[Any]] = []

    async def scenario() -> tuple[Any, ...]:
        results = await asyncio.gather(asyncio.wrap_future(run.submit()), asyncio.wrap_future(run.submit()))
        futures.append(sleeper.submit(str(tmp_path), 300))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(futures[0]), timeout=2)  # cancels the launch
        return tuple(results)

    assert asyncio.run(scenario()) == ((2, 0), (2, 0))
    assert futures[0].cancelled()
    assert all(_gone(pid) for pid in _pids(tmp_path))


def test_submitted_launches_are_stopped_when_the_interpreter_exits(tmp_path: Path) -> None:
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from mplaunch import parallel
from tests.workers import record_and_sleep

future = parallel(nprocs=2, start_method="fork")(record_and_sleep).submit({str(tmp_path)!r}, 300)
while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"pid-{{rank}}")) for rank in range(2)):
    time.sleep(0.05)
print("exiting with a running launch", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exiting with a running launch" in done.stdout
    pids = _pids(tmp_path)
    assert len(pids) == 2, pids
    assert all(_gone(pid) for pid in pids), pids
    assert _lines(tmp_path / "finally-0") == ["ran"]  # stopped (SIGTERM), not killed with the parent


def test_ctrl_c_while_waiting_stops_that_launch_only(tmp_path: Path) -> None:
    """Issue 37, item 8: an interrupted notebook cell stopped every running launch. Ctrl-C (a cell's interrupt)
    stops the launch it waits on, here the values of a submitted stream (``result()`` did already), and leaves
    the other submitted launches running."""
    other_dir, waited_dir = tmp_path / "other", tmp_path / "waited"
    other_dir.mkdir()
    waited_dir.mkdir()
    options = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=5)
    other = options(record_and_sleep).submit(str(other_dir), 300)
    waited = options(yielding).submit(record_and_sleep, str(waited_dir), 300)
    _wait_for_workers(other_dir)
    stop = _ctrl_c_when(lambda: all((waited_dir / f"pid-{rank}").exists() for rank in range(2)))
    try:
        with pytest.raises(KeyboardInterrupt):
            list(waited.items)  # type: ignore[attr-defined]
    finally:
        stop()
    try:
        assert waited.cancelled()
        assert all(_gone(pid) for pid in _pids(waited_dir))
        assert _lines(waited_dir / "finally-0") == ["ran"]  # stopped (SIGTERM): its finally block ran
        assert other.running()
        assert not any(_gone(pid) for pid in _pids(other_dir))
    finally:
        assert other.cancel()


# --- options --------------------------------------------------------------------------------------------------


def test_options_replace_some_options_and_leave_the_function_unchanged() -> None:
    original = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(world)
    config = original.config
    one = original.options(nprocs=1, max_restarts=1)
    assert one() == (1, 0)
    assert one.config.max_restarts == 1
    assert one.config.timeout == TIMEOUT
    assert original.config is config
    assert original() == (2, 0)
    assert one.__name__ == "world"
    assert one.__wrapped__ is world
    with pytest.raises(InvalidOptionError, match="nprocs=0 is not valid"):
        original.options(nprocs=0)
    with pytest.raises(TypeError, match="return_all"):
        original.options(return_all=True)  # type: ignore[call-arg]
    assert original.config is config


def print_and_fail_once() -> int:
    info = worker_info()
    print(f"attempt {info.restart_count} of rank {info.rank}")
    if info.restart_count == 0:
        raise ValueError("first attempt failed")
    return info.restart_count


OPTIONS_MODULE = """
from mplaunch import parallel

COUNT = 0

@parallel(nprocs=1, start_method="spawn", timeout=120)
def bump():
    global COUNT
    COUNT += 1
    import options_module_of_a_test as module
    return COUNT, module.COUNT, bump.__wrapped__.__code__.co_filename
"""


def test_a_copy_with_other_options_runs_with_its_modules_globals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fn.options(...) sent its function by value under spawn: it wrote a private copy of its module's globals
    that the module's other functions never saw, and tracebacks named '<dynamic-code>' (a new user's report)."""
    import pickle

    (tmp_path / "options_module_of_a_test.py").write_text(OPTIONS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "options_module_of_a_test", raising=False)
    import options_module_of_a_test as module  # type: ignore[import-not-found]

    count, seen_by_the_module, filename = module.bump.options(timeout=100)()
    assert (count, seen_by_the_module) == (1, 1)
    assert filename == str(tmp_path / "options_module_of_a_test.py")
    copy = pickle.loads(pickle.dumps(module.bump.options(timeout=90)))  # other picklers: the same function
    assert copy.__wrapped__ is module.bump.__wrapped__
    assert copy.config.timeout == 90
    monkeypatch.delitem(sys.modules, "options_module_of_a_test")


WRAPPED_MODULE = """
import functools
from mplaunch import parallel

def traced(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return ("the wrapper ran", fn(*args, **kwargs))
    return inner

def work():
    return "the plain function ran"

par_work = parallel(nprocs=1, start_method="spawn", timeout=120)(work)
work = traced(work)  # the name now finds a wrapper of the same plain function, not the decorated one
"""


def test_a_copy_whose_name_finds_another_wrapper_runs_its_own_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy is sent as the decorated function its name finds, and only that: a functools.wraps wrapper of
    the same function, found by the name, ran in the workers instead (found by a break-it pass)."""
    (tmp_path / "wrapped_module_of_a_test.py").write_text(WRAPPED_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wrapped_module_of_a_test", raising=False)
    import wrapped_module_of_a_test as module  # type: ignore[import-not-found]

    assert module.par_work.options(timeout=100)() == "the plain function ran"
    monkeypatch.delitem(sys.modules, "wrapped_module_of_a_test")


GUARDED_SCRIPT = """
from mplaunch import parallel

@parallel(nprocs=1, start_method="spawn", timeout=120)
def runner(f, x):
    return f(x)  # in the worker: runs in-process

if __name__ == "__main__":
    @parallel(nprocs=1, start_method="spawn", timeout=120)
    def guarded(x):
        return ("guarded", x)

    print(runner(guarded.options(timeout=100), 3))
"""


@pytest.mark.slow
def test_a_copy_of_a_function_under_the_main_guard_travels_by_value(tmp_path: Path) -> None:
    """A copy passed as an argument went by reference to its original, which a spawn worker's __main__ does
    not define: "Can't get attribute 'guarded'" (found by a break-it pass)."""
    script = tmp_path / "guarded_copy.py"
    script.write_text(GUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "('guarded', 3)" in done.stdout


def test_a_restart_appends_to_the_logs_of_the_failed_attempt(tmp_path: Path) -> None:
    run = parallel(nprocs=1, start_method="fork", max_restarts=1, log_dir=tmp_path, timeout=TIMEOUT)
    with pytest.warns(RestartWarning):
        assert run(print_and_fail_once)() == 1
    log = (tmp_path / "rank0.log").read_text()
    assert log.index("attempt 0 of rank 0") < log.index("--- restart 1") < log.index("attempt 1 of rank 0")


@pytest.mark.slow
def test_restart_under_spawn_reuses_the_payload(tmp_path: Path) -> None:
    tensor = torch.arange(100_000, dtype=torch.float64)  # in a file of its own: read again by the restart
    run = parallel(nprocs=1, start_method="spawn", max_restarts=1, timeout=TIMEOUT)(sum_after_one_failure)
    with pytest.warns(RestartWarning, match="first attempt failed"):
        assert run(tensor) == (1, tensor.sum().item())


def sum_after_one_failure(tensor: torch.Tensor) -> tuple[int, float]:
    count = worker_info().restart_count
    tensor.add_(1)  # private to this attempt: the next one starts from the caller's values
    if count == 0:
        raise ValueError("first attempt failed")
    return count, tensor.sub_(1).sum().item()


def test_submit_checks_the_main_guard_at_the_line_that_submits(tmp_path: Path) -> None:
    """The check runs in submit(), while the caller still stands on that line; the refusal is the future's."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"""\
import sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from mplaunch import parallel

def compute():
    return 1

future = parallel(nprocs=1, start_method="spawn")(compute).submit()
print(type(future.exception(timeout=30)).__name__, "line 8" in str(future.exception()))
"""
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["LaunchRefusedError", "True"], done.stdout + done.stderr


def draw() -> torch.Tensor:
    return torch.rand(3)


def test_submit_captures_the_random_state_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch._parent import checks

    started = threading.Event()
    check = checks.check_not_bootstrapping

    def late_in_the_launch_thread(name: str) -> None:  # the launch thread starts only after the caller reseeded
        if threading.current_thread() is not threading.main_thread():
            started.wait(10)
        check(name)

    monkeypatch.setattr(checks, "check_not_bootstrapping", late_in_the_launch_thread)
    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(draw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        expected = torch.rand(3)
        torch.manual_seed(0)
        future = run.submit()
        torch.manual_seed(1)  # after submit(): not what the workers start from
        started.set()
        assert torch.equal(future.result(timeout=TIMEOUT), expected)


def test_ctrl_c_while_waiting_for_a_submitted_launch_stops_it(tmp_path: Path) -> None:
    future = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(record_and_sleep).submit(str(tmp_path), 300)
    _wait_for_workers(tmp_path)
    cancel = _ctrl_c_when(lambda: main_thread_in("result", os.path.join("concurrent", "futures", "_base.py")))
    try:
        with pytest.raises(KeyboardInterrupt):
            future.result(timeout=TIMEOUT)
    finally:
        cancel()
    assert future.cancelled()
    assert all(_gone(pid) for pid in _pids(tmp_path))
