"""How launches fail: typed errors, ranks, tracebacks, and nothing left running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast

import pytest

from mplaunch import (
    LaunchRefusedError,
    LaunchTimeoutError,
    RemoteError,
    RemoteTraceback,
    Stream,
    WorkerExitedError,
    Workers,
    parallel,
)
from mplaunch._worker import setup
from tests import workers

TIMEOUT = 90


def launch(function: Callable[..., Any], start_method: str = "fork", **options: object) -> Callable[..., Any]:
    run: Callable[..., Any] = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT, **options)(function)  # type: ignore[call-overload]
    return run


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_exception_keeps_its_type_rank_and_traceback(start_method: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value") as caught:
        launch(workers.raise_value_error, start_method)()  # rank 0 sleeps 300 s: it must be stopped
    assert time.monotonic() - start < 100  # generous: spawn imports torch twice on a possibly busy machine
    error = caught.value
    assert error.rank == 1  # type: ignore[attr-defined]
    assert isinstance(error.pid, int)  # type: ignore[attr-defined]
    assert error.pid != os.getpid()  # type: ignore[attr-defined]
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "raise ValueError(message)" in str(error.__cause__)
    assert "rank 1" in str(error.__cause__)


def test_first_failure_wins_and_the_others_are_kept(tmp_path: Path) -> None:
    """Rank 1 raises only when the stop that follows rank 0's failure reaches it: rank 0's failure is raised,
    and rank 1's own exception, raised while it was being stopped, is kept (a stop alone would not be)."""
    with pytest.raises(KeyError) as caught:
        launch(workers.raise_everywhere_rank1_when_stopped)(str(tmp_path / "ready"))
    assert caught.value.rank == 0  # type: ignore[attr-defined]
    assert caught.value.args == ("rank 0",)
    others = caught.value.failures  # type: ignore[attr-defined]
    assert [(type(o), o.args, o.rank) for o in others] == [(KeyError, ("rank 1",), 1)]


def test_sys_exit_zero_without_result_is_a_failure() -> None:
    with pytest.raises(WorkerExitedError, match=r"rank 0 .*SystemExit\(0\)") as caught:
        launch(workers.exit_zero_on_rank0)()
    assert caught.value.rank == 0


def test_keyboard_interrupt_in_a_worker_is_a_failure_not_a_success() -> None:
    with pytest.raises(WorkerExitedError, match="KeyboardInterrupt"):
        launch(workers.keyboard_interrupt_on_rank0)()


@pytest.mark.parametrize(("rank", "code"), [(0, 0), (1, 3)])
def test_os_exit_is_reported_with_its_code(rank: int, code: int) -> None:
    with pytest.raises(WorkerExitedError, match=f"exited with code {code}") as caught:
        launch(workers.os_exit_on_rank)(rank, code)
    assert (caught.value.rank, caught.value.exitcode) == (rank, code)


@pytest.mark.parametrize(("signum", "text"), [(signal.SIGKILL, "out-of-memory"), (signal.SIGSEGV, "SIGSEGV")])
def test_death_by_signal_names_the_signal(signum: int, text: str) -> None:
    with pytest.raises(WorkerExitedError, match=text) as caught:
        launch(workers.kill_self)(signum)
    assert caught.value.signal_name == signal.Signals(signum).name
    assert caught.value.exitcode == -signum


def test_timeout_stops_everything_and_names_the_running_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        parallel(nprocs=2, start_method="fork", timeout=1.0)(workers.sleep)(30)
    assert time.monotonic() - start < 10
    assert caught.value.running == (0, 1)
    assert isinstance(caught.value, TimeoutError)


def test_worker_ignoring_sigterm_does_not_hold_the_call() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        launch(workers.ignore_sigterm_and_sleep, grace_period=0.5)(30)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_stopped_workers_run_their_finally_blocks_and_atexit(tmp_path: Path, start_method: str) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        launch(workers.finally_marker, start_method)(str(marker))
    assert marker.read_text() == "finally ran"
    assert (tmp_path / "marker.atexit").read_text() == "atexit ran"


def _set_up_fails() -> None:
    raise RuntimeError("the rank's set-up failed here")


def test_a_rank_whose_set_up_fails_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the function runs (a rank of a joblib worker could not set loky's start method): the set-up's
    error is the rank's failure, with its traceback; it was ``exited with code 1 before returning``. Forked
    ranks inherit the broken step."""
    monkeypatch.setattr(setup, "follow_own_rendezvous", _set_up_fails)
    with pytest.raises(RuntimeError, match="set-up failed") as launched:
        parallel(nprocs=2, start_method="fork", timeout=60)(workers.identity)(1)
    with Workers(nprocs=2, start_method="fork", timeout=60) as warm, pytest.raises(RuntimeError) as served:
        warm.run(workers.identity, 1)
    for error in (launched.value, served.value):
        assert "set-up failed" in str(error.__cause__)
        assert getattr(error, "rank", None) in (0, 1)


def test_unpicklable_exception_arrives_as_remote_error() -> None:
    with pytest.raises(RemoteError, match="custom failure") as caught:
        launch(workers.raise_unpicklable)()
    assert caught.value.type_name == "tests.workers.Unpicklable"
    assert "raise Unpicklable" in str(caught.value.__cause__)


def test_exception_that_cannot_be_unpickled_arrives_as_remote_error() -> None:
    with pytest.raises(RemoteError, match="7: cannot be rebuilt") as caught:
        launch(workers.raise_needs_two_arguments)()
    assert caught.value.type_name == "tests.workers.NeedsTwoArguments"


def test_huge_message_does_not_deadlock() -> None:
    with pytest.raises(RuntimeError) as caught:
        launch(workers.raise_huge_message)(8 * 2**20)
    assert len(str(caught.value)) == 8 * 2**20


def test_unpicklable_result_is_a_remote_error_with_a_failed_exit() -> None:
    """Issue 11: documented as RemoteError, it arrived as TypeError, and the rank exited 0."""
    with pytest.raises(RemoteError, match=r"result of rank 0 \(type builtins.dict\) could not be pickled") as caught:
        launch(workers.return_unpicklable)()
    assert caught.value.rank == 0
    assert caught.value.type_name == "builtins.dict"
    assert "_thread.lock" in str(caught.value)
    assert isinstance(caught.value.__cause__, RemoteTraceback)


def test_an_open_file_returned_by_a_rank_is_refused_with_the_fix_for_a_result(tmp_path: Path) -> None:
    """The refusal advised 'open it inside the function', which the rank had done (a new user's report)."""
    with pytest.raises(RemoteError, match="pass or return its path") as caught:
        launch(workers.return_open_file)(str(tmp_path / "out.txt"))
    assert "open it inside the function" not in str(caught.value)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_unpicklable_argument_is_refused_before_launching(start_method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    start = BaseProcess.start

    def record(process: BaseProcess) -> None:
        started.append(process.name)
        start(process)

    monkeypatch.setattr(BaseProcess, "start", record)
    with pytest.raises(LaunchRefusedError, match=r"positional argument 1 \(args\[1\]: _thread\.lock\)"):
        launch(workers.identity, start_method)(1, threading.Lock())
    assert started == []  # no worker was started


def test_fork_needs_no_pickling() -> None:
    assert launch(workers.call_holding, "fork")(lambda: 1, threading.Lock()) == 1


def test_failures_of_ranks_that_raised_at_the_same_time_are_kept() -> None:
    with pytest.raises(KeyError) as caught:
        launch(workers.raise_at_once)()
    others = caught.value.failures  # type: ignore[attr-defined]
    assert len(others) == 1
    assert isinstance(others[0], KeyError)
    assert {caught.value.rank, others[0].rank} == {0, 1}  # type: ignore[attr-defined]


def test_an_exception_whose_str_raises_still_arrives() -> None:
    with pytest.raises(workers.BrokenStr) as caught:
        launch(workers.raise_broken_str)()
    assert caught.value.rank == 1  # type: ignore[attr-defined]
    assert caught.value.failures == ()  # type: ignore[attr-defined]


def test_nccl_without_cuda_is_refused_before_launching() -> None:
    import torch

    if torch.cuda.device_count():  # (is_available() would initialise the driver: fork refused after it)
        pytest.skip("this machine has CUDA")
    with pytest.raises(LaunchRefusedError, match="backend='nccl' needs CUDA"):
        parallel(nprocs=2, start_method="fork", backend="nccl")(workers.sleep)(0)


# --- errors that say where (issue 37) -------------------------------------------------------------------------


def test_what_cannot_be_sent_is_named_by_its_path_returned_or_yielded() -> None:
    """An unpicklable result named only its top type (``builtins.dict``), and a yielded one raised a bare
    TypeError. Both raise RemoteError now, naming the path to the part that cannot be pickled; also from warm
    workers, whose values travel through the launch directory."""
    one = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)
    with pytest.raises(RemoteError, match=r"\(result\['trainer'\]\.logger: _thread\.lock\): TypeError") as caught:
        one(workers.return_holder)()
    assert caught.value.rank == 0
    with pytest.raises(RemoteError, match=r"the value #1 that rank 0 yielded .*\(value\[0\]\.logger: _thread\.lock\)"):
        list(cast(Stream[Any], one(workers.yield_holder)()))
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT) as warm:
        with pytest.raises(RemoteError, match=r"\(result\['trainer'\]\.logger: _thread\.lock\)"):
            warm.run(workers.return_holder)
        with pytest.raises(RemoteError, match=r"\(value\[0\]\.logger: _thread\.lock\)"):
            list(warm.run(workers.yield_holder))


def test_an_argument_that_cannot_be_sent_is_named_by_its_path() -> None:
    spawned = parallel(nprocs=1, start_method="spawn", timeout=TIMEOUT)(workers.identity)
    with pytest.raises(LaunchRefusedError, match=r"positional argument 0 \(args\[0\]\['trainer'\]\.logger: _thread"):
        spawned({"trainer": workers.Holder()})
    with pytest.raises(LaunchRefusedError, match=r"keyword argument 'model' \(model\.logger: _thread\.lock\)"):
        spawned(model=workers.Holder())
    held = workers.Holder()
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT) as warm:  # a closure, sent by value
        with pytest.raises(LaunchRefusedError, match=r"the function \(<lambda>'s closure variable held\.logger"):
            warm.run(lambda: held.weights)


def test_backend_and_the_functions_own_init_process_group_name_the_clash() -> None:
    """backend='gloo' and the function's own init_process_group raised torch's bare 'trying to initialize the
    default process group twice!'. The error now says which two did it and the two ways out."""
    clash = r"backend='gloo' made mplaunch initialise the default process group .* Either leave out backend="
    with pytest.raises(ValueError, match=clash):
        parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, backend="gloo")(workers.init_own_group)()
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, backend="gloo") as warm:
        with pytest.raises(ValueError, match=clash):
            warm.run(workers.init_own_group)
    assert parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.init_own_group)() == 0  # no backend=


def test_a_warm_failure_after_the_ranks_were_started_again_says_their_state_is_gone() -> None:
    """The call after a rank died ran on new ranks and failed with NameError, after a warning easy to miss
    (a notebook). The first failure on the new ranks now carries a note that what earlier calls left is gone."""
    from tests import warm_workers

    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT) as warm:
        warm.run(warm_workers.keep, "model", "weights")
        assert warm.run(warm_workers.read_kept, "model") == "weights"
        with pytest.raises(WorkerExitedError):
            warm.run(warm_workers.exit_in_rank, 0, 3)
        with pytest.warns(RuntimeWarning, match="all ranks were started again"), pytest.raises(KeyError) as caught:
            warm.run(warm_workers.read_kept, "model")
        if sys.version_info >= (3, 11):  # (add_note)
            assert "what earlier calls left in them (globals, models, the process group) is gone" in str(
                caught.value.__notes__
            )
        with pytest.raises(KeyError) as again:  # a later failure is its own
            warm.run(warm_workers.read_kept, "model")
        assert not any("is gone" in note for note in getattr(again.value, "__notes__", []))


def test_workers_are_not_called_from_a_process_that_has_only_a_copy_of_them() -> None:
    """A call on Workers from inside one of their own ranks: passed in, it is refused naming them; reached in
    a rank forked with a copy of them (started again after a death), it raises naming them."""
    from tests import warm_workers

    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT) as warm:
        with pytest.raises(LaunchRefusedError, match=r"<mplaunch\.Workers nprocs=1 .* cannot be sent to another"):
            warm.run(warm_workers.call_workers, warm)
        warm_workers.KEPT_WORKERS = warm
        try:
            with pytest.raises(WorkerExitedError):
                warm.run(warm_workers.exit_in_rank, 0, 3)
            copy = r"<mplaunch\.Workers nprocs=1 .* and their ranks belong to process"
            with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=copy):
                warm.run(warm_workers.call_kept_workers)
        finally:
            warm_workers.KEPT_WORKERS = None
