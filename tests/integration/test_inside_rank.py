"""Inside a rank, things behave as in a process that torchrun starts (issue 10)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch

from mplaunch import StartMethod, parallel
from tests import workers

TIMEOUT = 120


@pytest.mark.parametrize(
    ("start_method", "contexts"),
    [  # spawn ranks: in the last case, whose one rank also runs DataLoaders of the default start method
        ("forkserver", (None,)),
        ("fork", (None,)),
        pytest.param("spawn", (None, "forkserver", "spawn"), marks=pytest.mark.slow),
    ],
)
def test_tensor_arguments_are_ordinary_tensors_in_the_rank(
    start_method: StartMethod, contexts: tuple[str | None, ...]
) -> None:
    """Arguments mapped from the launch directory reported is_shared(), so DataLoader workers failed with
    'Bad file descriptor' once an argument passed 64 KiB; the rank's default start method was its own
    (spawn), where a torchrun rank's is the platform's. With DataLoaders of every start method, one rank:
    each spawned process imports torch."""
    nprocs = 2 if contexts == (None,) else 1
    launch = parallel(nprocs=nprocs, start_method=start_method, timeout=TIMEOUT, return_all=True)
    results = launch(workers.load_through_dataloader)(torch.arange(100_000, dtype=torch.float32), contexts)
    for result in results:
        assert result["counts"] == {str(context): 200_000 for context in contexts}
        assert result["default_start_method"] == multiprocessing.get_start_method()
        assert result["queued"]
        assert result["saved"]
        assert result["shared"]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_nested_call_runs_in_process_as_that_rank(start_method: StartMethod) -> None:
    """It started N x N processes under spawn and failed with 'process group initialised twice' under fork."""
    outer = parallel(nprocs=2, start_method=start_method, backend="gloo", timeout=TIMEOUT, return_all=True)
    results = outer(workers.outer_with_nested_call)()
    assert results == [{"value": 3.0, "same_pid": True, "group_kept": True}] * 2


def test_debug_runs_here_as_rank_0_of_1_with_the_workers_setup() -> None:
    import torch.distributed as dist

    @parallel(nprocs=2, backend="gloo")
    def train(x: int) -> dict[str, object]:
        value = torch.tensor([float(x)])
        dist.all_reduce(value)
        nested = parallel(nprocs=2)(os.getpid)()
        return {
            "value": value.item(),
            "world": dist.get_world_size(),
            "pid": os.getpid(),
            "nested": nested,
            "rank": os.environ["RANK"],
            "port": os.environ["MASTER_PORT"],
        }

    before, hook = dict(os.environ), sys.excepthook
    result = train.debug(5)
    assert sys.excepthook is hook  # torch's "[rank0]:" hook goes with the process group
    assert result["value"] == 5.0
    assert result["world"] == 1
    assert result["rank"] == "0"
    assert result["pid"] == os.getpid() == result["nested"]
    assert not dist.is_initialized()
    assert dict(os.environ) == before


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_process_the_function_forks_never_replaces_the_result(start_method: StartMethod) -> None:
    """A child of os.fork() that returned instead of exiting went on as the worker: its value could replace
    the rank's, and the call waited for it. It now leaves at once and the worker's value is the rank's."""
    launch = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT, return_all=True)
    start = time.monotonic()
    results = launch(workers.fork_and_fall_through)(30.0)
    assert [kind for kind, _ in results] == ["parent", "parent"]
    assert time.monotonic() - start < 20  # the call did not wait for the children's 30 s


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_multiprocessing_sees_the_rank_and_its_live_parent(start_method: StartMethod) -> None:
    """Forked workers are started without multiprocessing's Popen (no pipes, no finalizer per worker), yet
    each is ``current_process()`` with its rank's name and sees the launching process as its live
    ``parent_process()``, as a spawned worker does."""
    fn = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT, return_all=True)(workers.multiprocessing_view)
    assert fn() == [("mplaunch-rank0", os.getpid(), True, False), ("mplaunch-rank1", os.getpid(), True, False)]
    assert multiprocessing.active_children() == []
