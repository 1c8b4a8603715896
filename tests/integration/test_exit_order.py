"""A rank's exit: its ``atexit`` handlers run while the processes it started still run; a result that exits
while it is pickled or unpickled ends in mplaunch's documented errors (issue 21, item 4)."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import pytest

from mplaunch import RemoteError, StartMethod, WorkerExitedError, parallel
from tests import compat_workers

METHODS = ["fork", "spawn", "forkserver"]


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("how", ["call", "submit"])
def test_atexit_handlers_run_while_the_ranks_children_live(start_method: StartMethod, how: str, tmp_path: Path) -> None:
    path = str(tmp_path / "metrics")
    fn = parallel(nprocs=1, start_method=start_method, timeout=120)(compat_workers.tracker_at_exit)
    result = fn(path) if how == "call" else fn.submit(path).result(timeout=120)
    assert result == 7
    with open(path) as file:
        assert file.read() == "final metrics"


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("ending", ["return", "raise", "sys.exit"])
def test_a_rank_runs_its_own_exit_handlers_never_the_parents(
    start_method: StartMethod, ending: str, tmp_path: Path
) -> None:
    """A forked rank inherits its parent's ``atexit`` handlers (a forkserver rank, its server's) and must not
    run them: the parent's "save the results" would run once per rank. The rank's own handlers run, its
    children still alive, however the function ends."""
    here = os.getpid()
    marks = tmp_path / "marks"
    marks.mkdir()

    def parents_handler() -> None:
        if os.getpid() != here:
            (marks / f"parent-handler-{os.getpid()}").touch()

    atexit.register(parents_handler)
    try:
        fn = parallel(nprocs=1, start_method=start_method, timeout=120)(compat_workers.register_exit_mark)
        if ending == "return":
            assert fn(str(marks), ending) == 0
        else:
            with pytest.raises((ValueError, WorkerExitedError)):
                fn(str(marks), ending)
    finally:
        atexit.unregister(parents_handler)
    names = sorted(path.name.split("-")[0] for path in marks.iterdir())
    assert names == ["rank"], names  # the rank's own handler ran, none of the parent's


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("how", ["call", "submit"])
def test_a_result_that_exits_when_pickled_is_an_exit(start_method: StartMethod, how: str, tmp_path: Path) -> None:
    path = str(tmp_path / "atexit")
    fn = parallel(nprocs=1, start_method=start_method, timeout=120)(compat_workers.result_exiting_when_pickled)
    with pytest.raises(WorkerExitedError, match=r"SystemExit\(3\) while its result .* was pickled") as caught:
        fn(path) if how == "call" else fn.submit(path).result(timeout=120)
    assert caught.value.exitcode == 3
    assert os.path.exists(path)  # the exit handlers still ran


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("how", ["call", "submit"])
def test_a_result_that_exits_when_unpickled_is_a_remote_error(start_method: StartMethod, how: str) -> None:
    fn = parallel(nprocs=1, start_method=start_method, timeout=120)(compat_workers.result_exiting_when_unpickled)
    with pytest.raises(RemoteError, match=r"cannot be unpickled in the parent: SystemExit: 4"):
        fn() if how == "call" else fn.submit().result(timeout=120)
