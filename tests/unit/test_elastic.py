"""How a node of a multi-node launch turns its ranks' outcome records into a result or one failure, in one
process: the records are written as workers write them, and torch elastic's failures are built by hand."""

from __future__ import annotations

import dataclasses
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mplaunch import NodeLostError, RestartWarning, WorkerExitedError
from mplaunch._config import ParallelConfig
from mplaunch._env import NodeSetup
from mplaunch._parent.nodes import elastic
from mplaunch._parent.nodes.elastic import _collect, _restarted
from mplaunch._parent.nodes.handler import WATCH_KEY, NodeWatch
from mplaunch._wire import transport
from mplaunch._wire.records import REMOTE_RANK0, Outcome, Raised, Returned, Signalled, outcome_name
from mplaunch._wire.spec import LaunchSpec


def raised(error: BaseException) -> Raised:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001
        return Raised.of(caught)


def write(directory: Path, outcomes: dict[int, Outcome]) -> None:
    for rank, outcome in outcomes.items():
        transport.dump(outcome, str(directory), outcome_name(rank))


def collect(directory: Path, failed: dict[int, Any] | None = None, return_all: bool = False) -> list[Any]:
    spec = LaunchSpec(
        directory=str(directory),
        nprocs=2,
        start_method="fork",
        parent_pid=os.getpid(),
        num_threads=1,
        reporting_ranks=frozenset({0}),
    )
    return _collect(spec, failed or {}, return_all)


def failure(pid: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<none>")


def test_a_rank_that_raised_wins_over_a_lower_rank_that_was_signalled(tmp_path: Path) -> None:
    write(tmp_path, {0: Signalled(100, signal.SIGTERM), 1: raised(ValueError("rank 1 fails"))})
    with pytest.raises(ValueError, match="rank 1 fails") as caught:
        collect(tmp_path)
    assert caught.value.rank == 1  # type: ignore[attr-defined]


def test_a_rank_that_raised_wins_over_a_lower_rank_that_elastic_saw_die(tmp_path: Path) -> None:
    write(tmp_path, {1: raised(KeyError("rank 1"))})
    with pytest.raises(KeyError) as caught:
        collect(tmp_path, failed={0: failure(100, -signal.SIGKILL), 1: failure(101, 1)})
    assert caught.value.rank == 1  # type: ignore[attr-defined]


def test_the_rank_that_raised_first_comes_first(tmp_path: Path) -> None:
    """The first exception in time is the root cause (a peer of a failed rank fails in a collective after it),
    whatever the ranks' numbers; a rank elastic stopped (signalled) never wins over one that raised."""
    late, early = raised(KeyError("2")), raised(KeyError("3"))
    early = dataclasses.replace(early, when=late.when - 1.0)
    write(tmp_path, {0: Returned(100, 0), 1: Signalled(101, signal.SIGTERM), 2: late, 3: early})
    with pytest.raises(KeyError) as caught:
        collect(tmp_path)
    assert caught.value.rank == 3  # type: ignore[attr-defined]
    assert caught.value.args == ("3",)


def test_without_an_exception_the_lowest_failed_rank_is_reported(tmp_path: Path) -> None:
    write(tmp_path, {0: Returned(100, "zero"), 2: Signalled(102, signal.SIGTERM)})
    with pytest.raises(WorkerExitedError) as caught:
        collect(tmp_path, failed={1: failure(101, -signal.SIGKILL), 2: failure(102, 143)})
    error = caught.value
    assert (error.rank, error.pid, error.exitcode, error.signal_name) == (1, 101, -signal.SIGKILL, "SIGKILL")
    assert "out-of-memory" in str(error)


def test_a_rank_that_was_signalled_is_a_failure(tmp_path: Path) -> None:
    write(tmp_path, {0: Returned(100, "zero"), 1: Signalled(101, signal.SIGTERM)})
    with pytest.raises(WorkerExitedError, match="SIGTERM") as caught:
        collect(tmp_path)
    assert (caught.value.rank, caught.value.pid) == (1, 101)


def test_return_all_gives_this_nodes_values_in_rank_order(tmp_path: Path) -> None:
    write(tmp_path, {3: Returned(103, "three"), 2: Returned(102, "two")})  # node 1 of 2: ranks 2 and 3
    write(tmp_path, {10: Returned(110, "ten")})  # numbers, not names, order the ranks: 10 after 3
    assert collect(tmp_path, return_all=True) == ["two", "three", "ten"]
    assert os.listdir(tmp_path) == []  # each record is read once and removed


def test_rank_0_is_read_where_it_runs(tmp_path: Path) -> None:
    write(tmp_path, {1: Returned(101, None), 0: Returned(100, {"loss": 0.5})})
    transport.dump(Returned(1, "not this one"), str(tmp_path), REMOTE_RANK0)
    assert collect(tmp_path) == [{"loss": 0.5}]


def test_rank_0_of_another_node_is_fetched(tmp_path: Path) -> None:
    write(tmp_path, {2: Returned(102, None), 3: Returned(103, None)})
    transport.dump(Returned(1, "rank 0's value"), str(tmp_path), REMOTE_RANK0)
    assert collect(tmp_path) == ["rank 0's value"]
    assert os.listdir(tmp_path) == []


def test_a_failure_of_rank_0_on_another_node_is_raised_here_as_itself(tmp_path: Path) -> None:
    write(tmp_path, {2: Returned(102, None)})
    transport.dump(raised(OSError(28, "No space left")), str(tmp_path), REMOTE_RANK0)
    with pytest.raises(OSError, match="No space left") as caught:
        collect(tmp_path)
    assert caught.value.errno == 28
    assert caught.value.rank == 0  # type: ignore[attr-defined]


def test_the_failure_before_a_restart_is_the_lost_node_else_the_first_ranks(tmp_path: Path) -> None:
    """As a later round begins, the attempt before it is over: its failure is kept for ``earlier_attempts`` and
    announced, and its records are removed (the next attempt's ranks write theirs)."""
    spec = LaunchSpec(str(tmp_path), 2, "fork", os.getpid(), 1, frozenset({0}))
    watch, earlier = NodeWatch("node-a:29400", 2, None, max_restarts=2), list[BaseException]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _restarted(spec, watch, earlier)  # no failure here (another node's ranks failed): nothing to announce
    assert earlier == []
    write(tmp_path, {0: Signalled(100, signal.SIGTERM), 1: raised(ValueError("rank 1 fails"))})
    with pytest.warns(RestartWarning, match=r"attempt 1 of 3 failed \(rank 1 raised ValueError: rank 1 fails"):
        _restarted(spec, watch, earlier)
    ((failure,)) = earlier
    assert isinstance(failure, ValueError) and failure.rank == 1  # type: ignore[attr-defined]
    assert os.listdir(tmp_path) == []
    write(tmp_path, {0: Signalled(100, signal.SIGTERM)})
    watch.lost_node = lost = NodeLostError("node 1 of 2 is gone", 1, "node-b", 20, "node-a:29400")
    with pytest.warns(RestartWarning, match=r"attempt 2 of 3 failed \(rank \? raised NodeLostError: node 1 of 2"):
        _restarted(spec, watch, earlier)
    assert earlier == [failure, lost] and watch.lost_node is None and os.listdir(tmp_path) == []


def test_earlier_attempts_are_kept_on_the_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure that ends the launch after a restart carries the earlier attempt's (as one node's launch does)."""
    import torch.distributed.launcher.api

    def elastic_launch(config: Any, entry: Any) -> Any:
        def run(worker: Any) -> None:
            write(tmp_path, {1: raised(ValueError("rank 1 fails in attempt 1"))})
            config.rdzv_configs[WATCH_KEY].on_restart()  # the agent's next round
            raise KeyError("attempt 2")

        return run

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", elastic_launch)
    nodes = NodeSetup(2, None, "node-a:29400", "mplaunch")
    spec = LaunchSpec(str(tmp_path), 2, "fork", os.getpid(), 1, frozenset({0}))
    with pytest.warns(RestartWarning, match=r"attempt 1 of 2 failed \(rank 1 raised ValueError: rank 1 fails"):
        with pytest.raises(KeyError) as caught:
            elastic.launch_nodes(spec, nodes, ParallelConfig(max_restarts=1))
    (first,) = caught.value.earlier_attempts  # type: ignore[attr-defined]
    assert isinstance(first, ValueError) and str(first) == "rank 1 fails in attempt 1"
