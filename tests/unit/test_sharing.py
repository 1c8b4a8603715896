"""unshare(): private copies of shared tensors, without walking what cannot hold one."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

from mplaunch import unshare
from mplaunch._state import sharing


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    name: str = "b"


def test_shared_tensors_are_made_private_in_place_wherever_they_sit() -> None:
    shared = torch.zeros(4).share_memory_()
    obj: dict[str, Any] = {
        "d": collections.OrderedDict(w=shared),
        "t": (Pair(shared, 1),),
        "s": [Batch(shared)],
        "n": 3,
    }
    assert unshare(obj) is obj
    assert obj["d"]["w"] is shared
    assert obj["t"][0].a is shared
    assert obj["s"][0].x is shared  # nothing rebuilt
    assert not shared.is_shared()
    assert torch.equal(shared, torch.zeros(4))
    assert type(obj["d"]) is collections.OrderedDict
    assert type(obj["t"][0]) is Pair
    assert obj["s"][0].name == "b"


def test_what_aliases_still_aliases() -> None:
    """Adversarial finding: each occurrence of a shared tensor was copied on its own, so `(t, t[10:])` and a
    module with the list of its parameters (what an optimizer gets) silently stopped sharing updates."""
    base = torch.zeros(100).share_memory_()
    view = base[10:]
    module = torch.nn.Linear(3, 3)
    module.share_memory()
    params = list(module.parameters())
    args = (base, view, base, params, module)
    unshare(args)
    assert not base.is_shared()
    assert not view.is_shared()
    assert not module.weight.is_shared()
    base[10] = 7.0
    assert view[0].item() == 7.0
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert params[0] is module.weight
    assert params[1] is module.bias


@dataclasses.dataclass
class Tagged:
    x: torch.Tensor
    name: str = dataclasses.field(init=False, default="unset")


class Labelled(list):  # type: ignore[type-arg]
    label = ""


class Slotted:
    __slots__ = ("tensor", "missing")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_any_object_is_looked_into_and_kept_as_it_is() -> None:
    """Adversarial findings: dataclasses lost their init=False fields, list subclasses their attributes, a
    tuple subclass with its own __new__ could not be rebuilt, a mappingproxy could not be copied, a cycle
    recursed forever, and a tensor held by a plain object stayed shared."""
    import types

    shared = torch.zeros(3).share_memory_()
    tagged = Tagged(shared)
    tagged.name = "train"
    labelled = Labelled([shared])
    labelled.label = "kept"
    cycle: list[Any] = [shared]
    cycle.append(cycle)
    holders = [
        tagged,
        labelled,
        types.MappingProxyType({"t": shared}),
        types.SimpleNamespace(t=shared),
        Slotted(shared),
        cycle,
        {shared: "a tensor as a key"},
    ]
    assert unshare(holders) is holders
    assert not shared.is_shared()
    assert tagged.name == "train"
    assert labelled.label == "kept"
    assert cycle[1] is cycle


def test_functions_classes_and_modules_are_not_looked_into() -> None:
    """A function's globals, or a class, would lead to every object of the program."""
    shared = torch.zeros(3).share_memory_()
    unshare((lambda: shared, type("Holder", (), {"t": shared}), torch))
    assert shared.is_shared()


def test_nothing_shared_returns_the_same_objects() -> None:
    obj = ({"a": torch.ones(2)}, [1, 2], Pair(torch.ones(1), 2))
    assert unshare(obj) is obj


def test_bytes_and_long_lists_are_not_walked_element_by_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 10: under fork, a 1 MiB bytes argument took 4 s and a list of 10**6 ints 4.6 s (the walk treated
    bytes as a sequence and visited every element in Python). Containers of plain values are passed over in
    one pass in C now: the Python-level walk looks into a handful of objects, not millions."""
    visits = []
    inside = sharing._inside

    def counting(obj: object) -> object:
        visits.append(type(obj))
        return inside(obj)

    monkeypatch.setattr(sharing, "_inside", counting)
    data = (b"x" * 2**22, list(range(10**6)), {i: float(i) for i in range(10**5)}, [torch.ones(1)] * 3)
    assert unshare(data) is data
    assert len(visits) < 10, visits


class _OneSlot:
    __slots__ = "only"  # a string, not a tuple

    def __init__(self, value: object) -> None:
        self.only = value


def test_layouts_and_dtypes_without_one_plain_storage_are_handled() -> None:
    """Sparse and quantized tensors have no storage to look up (asking raised NotImplementedError); empty
    and strided shared tensors of other dtypes are re-pointed like any other."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on sparse invariants and quantized tensors
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,)).coalesce()
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    empty = torch.zeros(0).share_memory_()
    strided = torch.ones(6, dtype=torch.bfloat16).share_memory_()[::2]
    held = torch.ones(2).share_memory_()
    args = (sparse, quantized, empty, strided, _OneSlot(held))
    assert unshare(args) is args
    assert not strided.is_shared()
    assert not held.is_shared()
    assert strided.tolist() == [1.0, 1.0, 1.0]
    assert strided.stride() == (2,)
    assert empty.numel() == 0


class _Broken:
    @property
    def __dict__(self) -> dict[str, object]:  # type: ignore[override]
        raise RuntimeError("no attributes today")


class _Lazy(collections.abc.Mapping[str, object]):
    """A mapping whose values cost something to get (a shelve, a database): never asked for them."""

    def __getitem__(self, key: str) -> object:
        raise KeyError(key)

    def __iter__(self) -> Any:
        return iter(["a"])

    def __len__(self) -> int:
        return 1


def test_gradients_deques_partials_and_objects_that_cannot_be_looked_into() -> None:
    """Second adversarial pass: Module.share_memory() shares .grad too, and the walk never reached a tensor's
    gradient or attributes, a deque, or a partial's arguments; an argument that raises when looked into (a
    dead weakref.proxy, a __dict__ property that raises, a mapping that cannot give its values) made the
    launch fail before any worker started."""
    import functools
    import weakref

    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.zeros_like(model.weight)
    model.share_memory()
    assert model.weight.grad is not None
    assert model.weight.grad.is_shared()
    held = [torch.zeros(2).share_memory_() for _ in range(3)]
    tagged = torch.zeros(1)
    tagged.extra = held[2]  # type: ignore[attr-defined]

    class Gone:
        pass

    dead = weakref.proxy(Gone())
    args = (model, collections.deque([held[0]]), functools.partial(print, held[1]), tagged, dead, _Broken(), _Lazy())
    unshare(args)
    assert not model.weight.grad.is_shared()
    assert not any(t.is_shared() for t in held)
