"""Giving a process private copies of the torch shared memory in an object (``unshare``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import types
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


# Types that hold no tensor; a container of nothing else is skipped with one pass in C (set(map(type, ...))).
_LEAVES = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice})
# Never looked into: code and namespaces, not data (a function's globals would lead everywhere).
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
    types.TracebackType,
)


def _inside(obj: Any) -> Iterable[Any]:
    """Return what the walk looks at inside ``obj``, running none of its own methods where possible."""
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return () if set(map(type, obj)) <= _LEAVES else obj
    if isinstance(obj, (dict, types.MappingProxyType)):
        if set(map(type, obj.values())) <= _LEAVES and set(map(type, obj.keys())) <= _LEAVES:
            return ()
        return itertools.chain(obj.keys(), obj.values())
    if isinstance(obj, torch.Tensor):  # its gradient (shared too after Module.share_memory()) and attributes
        grad = obj.grad if obj.is_leaf else None
        return [*([] if grad is None else [grad]), *vars(obj).values()]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, _OPAQUE):
        return ()
    try:
        attributes = vars(obj)
    except TypeError:  # no __dict__
        attributes = {}
    found: list[Any] = list(attributes.values()) if isinstance(attributes, dict) else []
    for kind in type(obj).__mro__:  # slots, read through their member descriptors (no user code runs)
        slots = kind.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            descriptor = kind.__dict__.get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                with contextlib.suppress(AttributeError):
                    found.append(descriptor.__get__(obj, kind))
    return found


def _torch_shared(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor`` is in torch's shared memory (``share_memory_()``)."""
    try:
        if tensor.layout == torch.sparse_coo:
            return bool(tensor._values().is_shared() or tensor._indices().is_shared())
        return bool(tensor.is_shared())
    except (RuntimeError, NotImplementedError):  # a layout without a storage to ask
        return False


def _walk(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor reachable from ``obj``, each once."""
    seen: set[int] = set()
    pending = [obj]
    while pending:
        item = pending.pop()
        if type(item) in _LEAVES or id(item) in seen:
            continue
        seen.add(id(item))
        try:
            inside = list(_inside(item))
        except Exception:  # noqa: BLE001 - an object that cannot be looked into (a dead weakref.proxy, a
            continue  # property that raises) holds nothing the walk could reach anyway
        if isinstance(item, torch.Tensor):
            yield item
        pending.extend(inside)


def unshare(obj: T, *, keep_requested: bool = False) -> T:
    """Make the shared memory in ``obj`` private to the calling process, in place, and return ``obj``.

    For a forked process, before its other threads use ``obj``: a tensor in torch's shared memory
    (``Tensor.is_shared()``, e.g. after ``Module.share_memory()``, which ``fork`` keeps shared) is re-pointed to a
    private copy of its storage, made once per storage, so views and every reference to the same tensor (a
    module's parameter and an optimizer's list) still alias each other. Other tensors are copy-on-write in a
    forked process already (mplaunch's results too). It looks inside containers, partials, tensors' gradients
    and any object's attributes, each object once, not into functions, classes or modules. NumPy arrays that
    view torch's shared memory stay shared. The idea comes from Lightning Fabric's launcher.

    Args:
        obj: tensors, modules, or collections and objects holding them.
        keep_requested: leave torch's shared memory shared (as hogwild training needs): nothing is changed
            (kept for code written for mplaunch 0.3, whose results were mapped shared).

    Returns:
        ``obj`` itself, holding no shared memory any more.

    Raises:
        OSError: no memory for a copy.
    """
    if keep_requested:
        return obj
    copies: dict[int, torch.UntypedStorage] = {}  # a shared storage's address -> its private copy
    with torch.no_grad():
        for found in list(_walk(obj)):
            if found.device.type != "cpu" or not _torch_shared(found):
                continue
            if found.layout != torch.strided or found.is_quantized:  # no one storage to re-point: a copy of its own
                found.data = found.data.clone()
                continue
            storage = found.untyped_storage()
            private = copies.get(storage.data_ptr())
            if private is None:
                private = copies[storage.data_ptr()] = storage.clone()
            view = torch.empty(0, dtype=found.dtype)
            found.data = view.set_(private, found.storage_offset(), found.size(), found.stride())
    return obj
