"""Results keep what the worker's value shares (issue 11): one storage, one copy, on the CPU."""

from __future__ import annotations

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
