"""Findings of a break-it session (branch ``breaker``): each test fails on the code it was written against.

Each test names its finding (B1, B2, ...) as the report numbers them. They are kept short: nprocs <= 2,
every launch with a ``timeout``, and a wait that ends on its own where the bug is a hang.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mplaunch import InvalidOptionError, StartMethod, WorkerExitedError, Workers, parallel, worker_info
from tests import warm_workers
from tests.helpers import run_script, write_script

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


# B1: under spawn and forkserver, a warm rank that dies during a call makes the parent spin at 100% CPU in
# _parent/exchange.py: the dead rank's pipe reads as ready at EOF, so `conns[rank].poll(0)` is true, the
# `continue` skips its end, `recv()` raises EOFError, and the loop goes round forever. `timeout` never
# fires (it is checked only when `wait` returns nothing). The call never returns.
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_b1_a_warm_rank_that_dies_fails_the_call(start_method: StartMethod) -> None:
    with Workers(nprocs=2, start_method=start_method, timeout=TIMEOUT, grace_period=1.0) as workers:
        future = workers.submit(warm_workers.exit_in_rank, 1, 3)
        with pytest.raises(WorkerExitedError) as caught:
            future.result(timeout=TIMEOUT)  # buggy: concurrent.futures.TimeoutError, the call still spinning
        assert caught.value.rank == 1


# B1, the same loop behind a decorated generator function (started as warm workers): the stream hangs. Run in
# a script of its own, which its own faulthandler ends if it hangs.
def test_b1_a_stream_whose_rank_dies_raises(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        """
        import faulthandler
        from mplaunch import WorkerExitedError, parallel
        from tests.integration.test_breaker_findings import values_then_exit_on_rank1

        if __name__ == "__main__":
            faulthandler.dump_traceback_later(40, exit=True)
            try:
                list(parallel(nprocs=2, start_method="spawn", timeout=20)(values_then_exit_on_rank1)())
            except WorkerExitedError as error:
                print("raised", error.rank)
        """,
    )
    result = run_script(script, timeout=90)
    assert result.stdout.strip() == "raised 1", result.stderr[-2000:]  # buggy: killed by faulthandler at 40 s


# B2: a warm rank started with fork runs in a copy of the parent's "mplaunch-starter" thread, and that thread
# is the child's only one: starter.in_starter() finds `_starter.is_alive()` true (it is the current thread),
# queues the start and waits for an answer that only it could give. Warm workers made inside such a rank
# never start; the outer call hangs until its own timeout.
def test_b2_warm_workers_inside_a_fork_started_warm_rank_start() -> None:
    with Workers(nprocs=1, start_method="fork", timeout=TIMEOUT, grace_period=1.0) as outer:
        rank, pid = outer.run(nested_warm_workers)  # buggy: LaunchTimeoutError after TIMEOUT s
    assert rank == 0
    assert pid not in outer.pids


# B3: the first call of spawn-started warm workers counts the ranks' start-up against its `timeout`.
# `Workers()` returns before the ranks have imported torch; a call made at once with a short timeout is
# "interrupted" while they still import (each prints a KeyboardInterrupt traceback from an import), the ranks
# die, and the next call starts new ones and may time out again the same way.
def test_b3_a_warm_calls_timeout_does_not_count_the_ranks_start() -> None:
    with Workers(nprocs=2, start_method="spawn", timeout=0.5) as workers:
        assert workers.run(warm_workers.rank_and_pid)[0] == 0  # buggy: LaunchTimeoutError


# B4: preempt_signals=(signal.SIGCHLD,) is accepted, and every launch then ends in PreemptedError: the
# parent gets SIGCHLD whenever a worker ends. (Synchronous signals, SIGSEGV, SIGBUS, SIGFPE, SIGILL, are
# accepted too.) Expected: an InvalidOptionError naming the signal.
def test_b4_sigchld_is_refused_as_a_preemption_signal() -> None:
    with pytest.raises(InvalidOptionError, match="SIGCHLD"):
        parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, preempt_signals=(signal.SIGCHLD,))(
            warm_workers.rank_and_pid
        )()  # buggy: PreemptedError "preempted by SIGCHLD"


# B5: env= names that no environment can hold are accepted when decorating, then fail in each worker with
# a bare ValueError("illegal environment variable name") / OSError(EINVAL) / ValueError("embedded null
# byte"), raised as if from the user's function, naming neither `env` nor the variable.
@pytest.mark.parametrize("variables", [{"A=B": "1"}, {"": "1"}, {"A\0": "1"}, {"A": "x\0y"}])
def test_b5_an_env_name_or_value_no_environment_holds_is_an_invalid_option(variables: dict[str, str]) -> None:
    with pytest.raises(InvalidOptionError, match="env"):
        parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, env=variables)(warm_workers.rank_and_pid)
