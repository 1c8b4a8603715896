"""Live values (issue 24): a generator function's values reach the caller as they are yielded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from mplaunch import StartMethod, Stream, Workers, parallel
from tests import warm_workers
from tests.helpers import gone

TIMEOUT = 90


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_value_reaches_the_caller_while_the_rank_still_runs(start_method: StartMethod, tmp_path: Path) -> None:
    """Rank 0 waits, after its first value, for a file that the test creates only once it has that value."""
    path = tmp_path / "go"
    function = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT)(warm_workers.values_then_wait)
    stream = cast(Stream[int], function(str(path)))
    assert next(stream) == 1
    path.touch()
    assert list(stream) == [2]
    assert stream.value == 3


def test_break_leaves_no_process() -> None:
    pids = []
    for pid in parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(warm_workers.pids_forever)():
        pids.append(pid)
        if len(pids) == 3:
            break
    assert gone(pids[:1], 0.1)


def test_close_and_with_leave_no_process() -> None:
    function = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(warm_workers.pids_forever)
    with cast(Stream[int], function()) as stream:
        pid = next(stream)
    assert gone([pid], 0.1)
    stream.close()  # again: nothing to do


def test_a_ranks_error_arrives_after_its_values_as_itself() -> None:
    received = []
    with pytest.raises(ValueError, match="after two values") as caught:
        for value in parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(warm_workers.values_then_raise)():
            received.append(value)
    assert received == [1, 2]
    assert caught.value.rank == 0  # type: ignore[attr-defined]


def test_return_all_yields_rank_value_pairs_from_every_rank() -> None:
    function = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, return_all=True)(warm_workers.ranked_values)
    stream = cast(Stream[Any], function(2))
    pairs = list(stream)
    assert sorted(pairs) == [(0, 0), (0, 1), (1, 100), (1, 101)]
    assert stream.value == [0, 1]


def test_warm_workers_stream_and_keep_their_ranks() -> None:
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        pids = workers.pids
        stream = workers.run(warm_workers.pids_forever)
        assert next(stream) == pids[0]
        stream.close()
        assert workers.run(warm_workers.ranked_values, 3).value is None  # not iterated yet
        assert list(workers.run(warm_workers.ranked_values, 3)) == [0, 1, 2]
        assert workers.pids == pids


def test_async_for_reads_the_values() -> None:
    async def read() -> list[int]:
        function = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(warm_workers.ranked_values)
        return [value async for value in cast(Stream[int], function(3))]

    assert asyncio.run(read()) == [0, 1, 2]


def test_submit_gives_the_values_and_a_future_of_the_return_value() -> None:
    future = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(warm_workers.ranked_values).submit(3)
    assert list(future.items) == [0, 1, 2]  # type: ignore[attr-defined]
    assert cast(int, future.result(TIMEOUT)) == 0


def test_streams_closed_at_once_leave_the_ranks_and_their_pipes_in_step() -> None:
    """A stream closed right after it started: the CANCEL and the SIGINT reach a rank as it starts the call.
    A KeyboardInterrupt between the reads of a message's length and body put its pipe out of step, and
    the rank ended ("exited with code 0 before returning"). A race: repeated."""
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
        pids = workers.pids
        for _ in range(200):
            workers.run(warm_workers.ranked_values, 3).close()
        assert list(workers.run(warm_workers.ranked_values, 3)) == [0, 1, 2]
        assert workers.pids == pids


def test_a_stream_closed_while_the_ranks_start_keeps_them() -> None:
    """The SIGINT of a stream closed at once reached ranks still starting, whose SIGINT handler then ended
    them (the next call warned that state was lost). A race: repeated."""
    for _ in range(10):
        with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as workers:
            pids = workers.pids
            workers.run(warm_workers.ranked_values, 3).close()
            assert workers.run(warm_workers.bump)[2] == 1
            assert workers.pids == pids


def test_large_yielded_tensors_travel_like_results() -> None:
    function = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(warm_workers.large_tensors)
    values = list(cast(Stream[Any], function(3)))
    assert [tuple(v.shape) for v in values] == [(256 * 1024,)] * 3
    assert [float(v[0]) for v in values] == [0.0, 1.0, 2.0]
    assert all(bool((v == v[0]).all()) for v in values)


def test_a_generator_with_stall_timeout_and_a_warm_call_both_report_usage() -> None:
    """A generator function ran on warm workers: stall_timeout was refused ("it applies to launches (@parallel)
    only") and no call of warm workers had a report. Now a stalled generator's launch raises StallError with a
    report, and so does a warm call; each rank's peak memory and CPU time are there."""
    from mplaunch import StallError
    from tests import workers

    stalling = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, stall_timeout=0.5)(workers.yielding)
    stream = stalling(workers.beat_then_fall_silent, 1, 3, 0.05)
    with pytest.raises(StallError, match="rank 1") as caught:
        list(stream)
    report = caught.value.report
    assert report is not None
    assert report is stalling.last_report
    assert [rank.rank for rank in report.ranks] == [0, 1]
    assert all(rank.max_rss and rank.stopped for rank in report.ranks), report
    with Workers(nprocs=2, start_method="fork", timeout=TIMEOUT) as warm:
        warm.run(warm_workers.rank_and_pid)
        report = warm.last_report
    assert report is not None
    assert [(rank.rank, rank.exitcode) for rank in report.ranks] == [(0, None), (1, None)]  # they serve on
    assert all(rank.max_rss and rank.user_time is not None for rank in report.ranks), report
