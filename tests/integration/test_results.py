"""Results keep what the worker's value shares (issue 11): one storage, one copy, on the CPU."""

from __future__ import annotations

import enum
import multiprocessing
import os
from typing import Any, cast

import numpy
import pytest
import torch

from mplaunch import StartMethod, Stream, Workers, parallel
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


# --- a kept result stays the caller's after the caller forks (issue 37) ---------------------------------------

_KEPT: dict[str, Any] = {}  # the value a fork Pool's workers reach by inheritance (arguments would be pickled)


def _overwrite(value: dict[str, Any]) -> int:
    """Write 7 over ``value``'s module, tensor and array, in place, as a child's dataset or job might."""
    with torch.no_grad():
        value["module"].weight.fill_(7)
    value["tensor"].numpy().fill(7)
    value["array"].fill(7)
    return 0


def _overwrite_kept(_: int) -> int:
    return _overwrite(_KEPT)


class _Overwriting(torch.utils.data.Dataset[int]):
    """A dataset whose worker changes a sample in place: here, the caller's kept result."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        return _overwrite(self.value)


def _children_write(value: dict[str, Any]) -> None:
    """Let three kinds of forked child write over ``value``: os.fork(), a DataLoader worker, a fork Pool's."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(_overwrite(value))
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    loader = torch.utils.data.DataLoader(_Overwriting(value), num_workers=1, multiprocessing_context="fork")
    assert [int(batch) for batch in loader] == [0]
    _KEPT.update(value)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.map(_overwrite_kept, [0]) == [0]
    finally:
        _KEPT.clear()


def _unchanged(value: dict[str, Any]) -> None:
    assert value["tensor"].abs().sum().item() == 0
    assert value["array"].any() == False  # noqa: E712 - numpy's bool
    assert value["module"].weight.abs().sum().item() == 0


def _results(way: str) -> list[dict[str, Any]]:
    """Results of workers.zeros_result (a module, tensor and array of zeros, 64 KiB or more) got ``way``."""
    launch = parallel(nprocs=1, start_method="fork", timeout=60)
    if way == "call":
        return [launch(workers.zeros_result)()]
    if way == "submit()":
        return [launch(workers.zeros_result).submit().result(60)]
    if way == "generator function":  # a value yielded, and the generator's return value
        stream = cast(Stream[Any], launch(workers.yielding)(workers.zeros_result))
        return [*stream, stream.value]
    with Workers(nprocs=1, start_method="fork", timeout=60) as warm:
        if way == "Workers.run":
            return [warm.run(workers.zeros_result)]
        return [warm.submit(workers.zeros_result).result(60)]


@pytest.mark.parametrize("way", ["call", "submit()", "generator function", "Workers.run", "Workers.submit"])
def test_a_kept_result_is_unchanged_by_what_the_callers_forked_children_write(way: str) -> None:
    """Issue 37: a result lived in a shared mapping of a memory file, so a child the caller forked later (its
    own os.fork(), a DataLoader worker changing a sample in place, a fork Pool's worker) wrote into the caller's
    tensor and array. A result is mapped copy-on-write now (streamed and warm values were read already)."""
    for value in _results(way):
        _children_write(value)
        _unchanged(value)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_an_argument_a_rank_keeps_is_unchanged_by_its_children(start_method: StartMethod) -> None:
    """The same in a rank: what its own forked children (DataLoader workers) write over an argument it keeps
    (mapped copy-on-write from the call's memory file under spawn, inherited under fork) stays theirs."""
    value: dict[str, Any] = {"module": torch.nn.Linear(256, 256, bias=False), "tensor": torch.zeros(1 << 16)}
    torch.nn.init.zeros_(value["module"].weight)
    value["array"] = numpy.zeros(1 << 16)
    run = parallel(nprocs=1, start_method=start_method, timeout=120)(_kept_in_rank)
    assert run(value) == [0.0, 0.0, 0.0]


def _kept_in_rank(value: dict[str, Any]) -> list[float]:
    _children_write(value)
    return [
        value["tensor"].abs().sum().item(),
        float(abs(value["array"]).sum()),
        value["module"].weight.abs().sum().item(),
    ]
