"""Warm workers and streams when a rank dies, when they are nested, and while their ranks start.

Kept short: nprocs <= 2, every launch with a ``timeout``, and a wait that ends on its own where a bug was a
hang.
"""

from __future__ import annotations

import os
import select
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mplaunch import LaunchTimeoutError, StartMethod, WorkerExitedError, Workers, worker_info
from tests import warm_workers, workers
from tests.helpers import gone, kernel_keeps_reaped_status, reaping_sigchld_handler, run_script, write_script

TIMEOUT = 30


def values_then_exit_on_rank1() -> Iterator[int]:
    """Every rank yields 1; then rank 1 exits with code 3 and rank 0 yields 2 after a short sleep."""
    yield 1
    if worker_info().rank == 1:
        os._exit(3)
    time.sleep(1)
    yield 2


def nested_warm_workers() -> tuple[int, int]:
    """Inside a warm rank: make warm workers of its own and return their rank 0's (rank, pid)."""
    with Workers(nprocs=1, start_method="fork", timeout=10) as inner:
        return inner.run(warm_workers.rank_and_pid)  # type: ignore[no-any-return]


def test_a_warm_rank_stopped_while_it_records_a_calls_error_ends() -> None:
    """A SIGTERM that landed while a warm rank pickled its call's error was swallowed there: the call raised
    a RemoteError "could not be sent as itself" and the rank went on serving calls, its stop ignored. The
    stop now ends the rank, as one a moment later would, and the call says so."""
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT, grace_period=1.0) as warm:
        pid = warm.pids[0]
        with pytest.raises(WorkerExitedError, match="was ended by SIGTERM") as caught:
            warm.run(workers.raise_stopped_while_pickled)
        assert caught.value.rank == 0
        assert gone([pid], within=5.0)  # (the rank ends at once; it lived until the block's end)


# Under spawn and forkserver, a warm rank that dies during a call makes the parent spin at 100% CPU in
# _parent/exchange.py: the dead rank's pipe reads as ready at EOF, so `conns[rank].poll(0)` is true, the
# `continue` skips its end, `recv()` raises EOFError, and the loop goes round forever. `timeout` never
# fires (it is checked only when `wait` returns nothing). The call never returns.
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_warm_rank_that_dies_fails_the_call(start_method: StartMethod) -> None:
    with Workers(nprocs=2, start_method=start_method, timeout=TIMEOUT, grace_period=1.0) as workers:
        future = workers.submit(warm_workers.exit_in_rank, 1, 3)
        with pytest.raises(WorkerExitedError) as caught:
            future.result(timeout=TIMEOUT)  # it was a TimeoutError: the call spun on
        assert caught.value.rank == 1


# The same loop behind a decorated generator function (started as warm workers): the stream hangs. Run in
# a script of its own, which its own faulthandler ends if it hangs.
def test_a_stream_whose_rank_dies_raises(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        """
        import faulthandler
        from mplaunch import WorkerExitedError, parallel
        from tests.integration.test_warm_deaths import values_then_exit_on_rank1

        if __name__ == "__main__":
            faulthandler.dump_traceback_later(40, exit=True)
            try:
                list(parallel(nprocs=2, start_method="spawn", timeout=20)(values_then_exit_on_rank1)())
            except WorkerExitedError as error:
                print("raised", error.rank)
        """,
    )
    result = run_script(script, timeout=90)
    assert result.stdout.strip() == "raised 1", result.stderr[-2000:]  # it hung until faulthandler ended it


# A warm rank started with fork runs in a copy of the parent's "mplaunch-starter" thread, and that thread
# is the child's only one: starter.in_starter() found `_starter.is_alive()` true (it is the current thread),
# queued the start and waited for an answer that only it could give. Warm workers made inside such a rank
# never started; the outer call hung until its own timeout.
def test_warm_workers_inside_a_fork_started_warm_rank_start() -> None:
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT, grace_period=1.0) as outer:
        rank, pid = outer.run(nested_warm_workers)  # it hung until the outer timeout
    assert rank == 0
    assert pid not in outer.pids


# The first call of spawn-started warm workers counted the ranks' start against its `timeout`. `Workers()`
# returns before the ranks have imported torch; a call made at once with a short timeout "interrupted" them
# while they still imported (each printed a KeyboardInterrupt traceback from an import), the ranks died, and
# the next call started new ones and could time out again the same way. The start has its own bound.
def test_a_warm_calls_timeout_does_not_count_the_ranks_start() -> None:
    with Workers(nprocs=2, start_method="spawn", timeout=0.5) as workers:
        assert workers.run(warm_workers.rank_and_pid)[0] == 0  # it was a LaunchTimeoutError


def test_ranks_that_do_not_start_within_rdzv_timeout_are_stopped() -> None:
    with Workers(nprocs=2, start_method="spawn", timeout=TIMEOUT, rdzv_timeout=0.05) as workers:
        with pytest.raises(LaunchTimeoutError, match=r"did not finish starting within rdzv_timeout=0.05 s"):
            workers.run(warm_workers.rank_and_pid)  # a spawned rank imports torch: far longer than 0.05 s
        pids = workers.pids
    assert gone(pids)


# A process forked from the one that made warm workers (a user's os.fork child, a fork-started helper) has
# copies of them. When such a child ended normally, its exit handlers closed the copies: they stopped the
# parent's ranks, whose next call started new ones with "ranks had died" and lost their state. A call there
# failed with multiprocessing's "can only join a child process".
def test_a_forked_child_neither_uses_nor_ends_its_parents_warm_workers(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        """
        import gc, os, sys, warnings
        from mplaunch import Workers
        from tests import warm_workers, workers

        def child(action):
            pid = os.fork()
            if pid == 0:
                if action == "exit":
                    sys.exit(0)  # exit handlers and finalizers run
                try:
                    workers.run(warm_workers.bump)
                except RuntimeError as error:
                    print("child:", "forked from it" in str(error), flush=True)
                workers.close()  # the child's copy only
                del globals()["workers"]
                gc.collect()
                os._exit(0)
            os.waitpid(pid, 0)

        if __name__ == "__main__":
            warnings.simplefilter("error")  # "ranks had died ... started again" would raise
            with Workers(nprocs=2, start_method="fork", timeout=60) as workers:
                pids = workers.pids
                workers.run(warm_workers.bump)
                child("exit")
                child("use")
                _, _, count = workers.run(warm_workers.bump)
                print("parent:", count, workers.pids == pids, flush=True)
        """,
    )
    done = run_script(script, timeout=120)
    assert done.stdout.split() == ["child:", "True", "parent:", "2", "True"], done.stdout + done.stderr[-3000:]


# The same for a stream (a generator function's call, and a warm call of one): the child's exit closed its
# copy of the stream, which interrupted the parent's ranks and read their messages; the parent then waited
# for values that never came, until its timeout.
@pytest.mark.parametrize("source", ["launch", "warm"])
def test_a_forked_child_leaves_its_parents_stream_alone(source: str, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        f"""
        import os, sys
        from mplaunch import Workers, parallel
        from tests import warm_workers, workers

        if __name__ == "__main__":
            workers = Workers(nprocs=2, start_method="fork", timeout=60) if {source!r} == "warm" else None
            if workers is None:
                stream = parallel(nprocs=2, start_method="fork", timeout=60)(warm_workers.ranked_values)(4)
            else:
                stream = workers.run(warm_workers.ranked_values, 4)
            first = next(stream)
            for action in ("read", "exit"):
                pid = os.fork()
                if pid == 0:
                    if action == "exit":
                        sys.exit(0)  # exit handlers, then the stream is collected
                    try:
                        next(stream)
                    except RuntimeError as error:
                        print("child:", "forked from it" in str(error), flush=True)
                    os._exit(0)
                os.waitpid(pid, 0)
            print("parent:", [first, *stream], flush=True)
            if workers is not None:
                workers.close()
        """,
    )
    done = run_script(script, timeout=120)
    assert done.stdout.split("\n")[:2] == ["child: True", "parent: [0, 1, 2, 3]"], done.stdout + done.stderr[-3000:]


# A caller's SIGCHLD handler that reaps every child (a server pattern) takes warm ranks' exit statuses too;
# a launch reads them through its pidfds, and warm workers did not (found by a break-it pass).


def _rank1_kills_itself() -> int:
    if worker_info().rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def _pid() -> int:
    return os.getpid()


@pytest.mark.skipif(not kernel_keeps_reaped_status(), reason="needs PIDFD_INFO_EXIT (Linux 6.15+)")
def test_a_warm_rank_reaped_by_the_callers_handler_is_named_by_its_signal() -> None:
    with reaping_sigchld_handler(), Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=1) as warm:
        with pytest.raises(WorkerExitedError) as caught:
            warm.run(_rank1_kills_itself)
    assert "was ended by SIGKILL" in str(caught.value), str(caught.value)


def test_a_warm_rank_killed_between_calls_under_a_reaping_handler_is_started_again() -> None:
    """The dead rank looked alive (multiprocessing cannot see a child someone else reaped): the next call went
    to it and failed, where without the handler the ranks are started again."""
    with reaping_sigchld_handler(), Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=1) as warm:
        pids = warm.pids
        pidfd = os.pidfd_open(pids[1])
        try:
            os.kill(pids[1], signal.SIGKILL)
            select.select([pidfd], [], [], TIMEOUT)
        finally:
            os.close(pidfd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "ranks had died or were stopped": as expected
            assert warm.run(_pid) not in pids


def test_closing_warm_workers_under_a_reaping_handler_signals_no_reaped_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() waited the whole grace_period for ranks the handler had reaped, then killed them by pid: a pid
    the kernel may have given to another process meanwhile."""
    from mplaunch._parent import ranks, signalling

    signalled: list[int] = []
    kill_tree = signalling.kill_tree

    def recording(process: Any) -> None:
        signalled.append(process.pid)
        kill_tree(process)

    monkeypatch.setattr(ranks, "kill_tree", recording)
    grace = 3.0
    with reaping_sigchld_handler() as reaped:
        warm = Workers(nprocs=2, start_method="fork", timeout=TIMEOUT, grace_period=grace)
        try:
            warm.run(_pid)
        finally:
            started = time.monotonic()
            warm.close()
            took = time.monotonic() - started
    assert not [pid for pid in signalled if pid in reaped], f"killed by pid after they were reaped: {signalled}"
    assert took < grace, f"close() took {took:.1f} s: the whole grace_period"
