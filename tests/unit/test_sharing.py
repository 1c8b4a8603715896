"""unshare(): private copies of shared tensors, without walking what cannot hold one."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from mplaunch import _sharing, unshare


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    name: str = "b"


def test_shared_tensors_are_copied_wherever_they_sit() -> None:
    shared = torch.zeros(4).share_memory_()
    obj: dict[str, Any] = {
        "d": collections.OrderedDict(w=shared),
        "t": (Pair(shared, 1),),
        "s": [Batch(shared)],
        "n": 3,
    }
    out = unshare(obj)
    for tensor in (out["d"]["w"], out["t"][0].a, out["s"][0].x):
        assert not tensor.is_shared() and torch.equal(tensor, shared)
    assert type(out["d"]) is collections.OrderedDict and type(out["t"][0]) is Pair
    assert type(out["s"][0]) is Batch and out["s"][0].name == "b" and out["n"] == 3
    assert obj["d"]["w"] is shared  # the caller's containers are not modified


def test_nothing_shared_returns_the_same_objects() -> None:
    obj = ({"a": torch.ones(2)}, [1, 2], Pair(torch.ones(1), 2))
    assert unshare(obj) is obj


def test_bytes_and_long_lists_are_not_walked_element_by_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 10: under fork, a 1 MiB bytes argument took 4 s and a list of 10**6 ints 4.6 s (the walk treated
    bytes as a sequence and visited every element in Python). Containers of plain values are passed over in
    one pass in C now: the Python-level walk visits a handful of objects, not millions."""
    visits = []
    walk = _sharing._unshare_any

    def counting(obj: object) -> object:
        visits.append(type(obj))
        return walk(obj)

    monkeypatch.setattr(_sharing, "_unshare_any", counting)
    data = (b"x" * 2**22, list(range(10**6)), {i: float(i) for i in range(10**5)}, [torch.ones(1)] * 3)
    assert unshare(data) is data
    assert len(visits) < 10, visits


def test_large_fork_arguments_are_walked_only_if_shared_memory_exists(tmp_path: Path) -> None:
    """Issue 10: walking a forked worker's arguments touches every element's reference count, which copies
    their pages (30 ms per worker for a list of 10**6 ints). Large arguments are walked only when the
    process maps shared writable memory at all; small ones in the parent (it costs microseconds), and in the
    workers only when they hold something other than plain values."""
    private = tmp_path / "private"
    private.write_text("7f00-7f01 r-xp 00000000 fd:00 1 /usr/lib/libc.so.6\n7f01-7f02 rw-p 00000000 00:00 0 \n")
    shared = tmp_path / "shared"
    shared.write_text(private.read_text() + "7f02-7f03 rw-s 00000000 00:1a 9 /dev/shm/torch_1_2_3 (deleted)\n")
    big: tuple[object, ...] = ([], {"values": list(range(10**5))})
    assert _sharing.unshare_verdict(big) is None  # large: up to the process's mappings
    assert not _sharing.shared_mappings(str(private)) and _sharing.shared_mappings(str(shared))
    assert _sharing.shared_mappings(str(tmp_path / "missing"))  # cannot tell: walk
    many_small = ([list(range(100)) for _ in range(200)],)  # 20,000 objects in all: large too
    assert _sharing.unshare_verdict(many_small) is None
    assert _sharing.unshare_verdict(([torch.ones(2)], {"lr": 0.1})) is True  # small, with a tensor
    assert _sharing.unshare_verdict(([object()], {})) is True  # an object that may hold one
    plain = ((b"x" * 2**22, [1, 2.5, "a", None], (range(3),)), {"lr": 0.1, "tags": {"x", "y"}})
    assert _sharing.unshare_verdict(plain) is False  # small and plain: nothing to walk in the workers


def test_a_process_with_a_shared_tensor_has_a_shared_mapping() -> None:
    """The premise of the check above, on this machine's torch: share_memory_() maps shared writable memory."""
    tensor = torch.zeros(1 << 16).share_memory_()
    assert tensor.is_shared() and _sharing.shared_mappings("/proc/self/maps")
