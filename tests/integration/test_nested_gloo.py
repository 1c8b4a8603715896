"""A fork launch from inside a rank that has a gloo group of its own (``MPLAUNCH_IN_PROCESS=0``) neither
hangs nor refuses to make a group: the forked workers do not inherit the rank's groups (issue 21, item 7)."""

from __future__ import annotations

import pytest

from mplaunch import StartMethod, parallel
from tests import compat_workers


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("backend", [None, "gloo"], ids=["own-group", "backend-option"])
def test_a_fork_launch_inside_a_gloo_rank(start_method: StartMethod, backend: str | None) -> None:
    outer = parallel(nprocs=2, start_method=start_method, timeout=90, return_all=True)(
        compat_workers.nested_fork_launch_in_a_gloo_rank
    )
    assert outer(backend) == [(2.0, 3.0), (2.0, 3.0)]
