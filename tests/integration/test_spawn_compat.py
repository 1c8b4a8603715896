"""Code written for ``torch.multiprocessing.spawn`` runs unchanged (issue 21, item 8): the DDP tutorial's
``ddp_setup`` (a rank sets ``MASTER_ADDR``/``MASTER_PORT`` itself), and ``mplaunch.spawn``."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

import mplaunch
from mplaunch import InvalidOptionError, StartMethod, parallel
from tests import compat_workers
from tests.helpers import free_port, run_script, write_script


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_ddp_tutorial_runs_under_spawn_compat(start_method: StartMethod) -> None:
    port = free_port()
    total = mplaunch.spawn(
        compat_workers.tutorial_main, args=(2, port), nprocs=2, start_method=start_method, timeout=100
    )
    assert total == 3.0


@pytest.mark.parametrize("init_method", [None, "tcp"])
def test_a_rank_that_sets_its_own_rendezvous_gets_it(init_method: str | None) -> None:
    port = free_port()
    url = None if init_method is None else f"tcp://localhost:{port}"
    fn = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True)(compat_workers.tutorial_in_rank)
    assert fn(port, url) == [3.0, 3.0]


def test_a_debugged_call_that_sets_its_own_rendezvous_gets_it(tmp_path: Path) -> None:
    """In a process of its own: torch keeps a DDP function's gloo group alive in the process that ran it, and
    a later fork launch of DDP code there (this test process's next test) could then deadlock in torch when
    its ranks free their model (see docs/guide/hangs.md)."""
    script = write_script(
        tmp_path,
        f"""
        from datetime import timedelta
        from mplaunch import parallel
        from tests import compat_workers

        if __name__ == "__main__":
            fn = parallel(nprocs=2, start_method="fork", timeout=60)(compat_workers.tutorial_in_rank)
            print(fn.debug({free_port()}, timeout=timedelta(seconds=20)))
        """,
    )
    done = run_script(script, timeout=120)
    assert done.stdout.strip() == "1.0", done.stderr[-2000:]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_spawn_passes_the_index_first_and_returns_rank0s_value(start_method: StartMethod) -> None:
    assert mplaunch.spawn(
        compat_workers.index_and_args, args=("a", 2), nprocs=2, start_method=start_method, timeout=60
    ) == (0, 0, ("a", 2))


def test_spawn_without_join_returns_a_future() -> None:
    future = mplaunch.spawn(
        compat_workers.index_and_args, args=[1], nprocs=2, join=False, start_method="fork", timeout=60
    )
    assert isinstance(future, Future)
    assert future.result(timeout=60) == (0, 0, (1,))


def test_spawn_checks_its_arguments() -> None:
    with pytest.raises(InvalidOptionError, match="args must be a tuple or list"):
        mplaunch.spawn(compat_workers.index_and_args, args=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="fn must be a function"):
        mplaunch.spawn(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="nprocs"):
        mplaunch.spawn(compat_workers.index_and_args, nprocs=0)
