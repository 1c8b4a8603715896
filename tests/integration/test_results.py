"""Results keep what the worker's value shares (issue 11): one storage, one copy, on the CPU."""

from __future__ import annotations

import enum

import pytest

from mplaunch import StartMethod, parallel
from tests import workers


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_views_and_tied_weights_share_storage_in_the_parent(start_method: StartMethod) -> None:
    result = parallel(nprocs=1, start_method=start_method, timeout=120)(workers.tied_result)("cpu")
    base, view = result["base"], result["view"]
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert view[0].item() == 100.0
    assert not base.is_shared()
    assert result["head"].weight.data_ptr() == result["embedding"].weight.data_ptr()
    base[100] = -1.0
    assert view[0].item() == -1.0  # one storage, as in the worker


class _Level(enum.IntEnum):
    HIGH = 2


def _same(value: object) -> object:
    return value


def test_scalars_and_none_come_back_with_their_types() -> None:
    """A rank's scalar (and every non-reporting rank's ``None``) is written by the standard pickler; a
    subclass of a scalar type (an ``IntEnum``) goes through mplaunch's own and keeps its class."""
    same = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True)(_same)
    for value in (None, True, 7, 2.5, 3 + 4j, "text", b"bytes", _Level.HIGH):
        got = same(value)
        assert got == [value, value] and [type(one) for one in got] == [type(value)] * 2
    assert parallel(nprocs=2, start_method="fork", timeout=60)(_same)("rank 1 sends None") == "rank 1 sends None"
