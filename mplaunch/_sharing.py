"""Moving results to the CPU, and giving a worker private copies of shared tensors."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import itertools
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from mplaunch._transport import in_shared_mapping

T = TypeVar("T")


def _apply(obj: Any, dtype: type, function: Any) -> Any:
    # imported on first use: lightning_utilities costs ~35 ms to import, more than all of mplaunch
    from lightning_utilities import apply_to_collection

    return apply_to_collection(obj, dtype, function)


def _module_to_cpu(module: torch.nn.Module) -> torch.nn.Module:
    return module.cpu()


def _tensor_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu()


def to_cpu(obj: T) -> T:
    """Return ``obj`` with every tensor on the CPU, recursing into dicts, lists, tuples, named tuples and
    dataclasses (``lightning_utilities.apply_to_collection``).

    Runs in the calling process. Tensors already on the CPU are returned as they are (no copy); other
    tensors are copied, one copy per tensor (tensors that shared a storage no longer do). An ``nn.Module`` is
    moved in place with ``Module.cpu()``. mplaunch itself does not need it for results: the transport copies
    each storage of a result to the CPU once, whatever object holds it, so views and tied weights stay tied.

    Args:
        obj: any object; typically a ``state_dict`` or a nested collection of tensors.

    Returns:
        The same structure with CPU tensors.

    Example:
        >>> to_cpu({"w": torch.ones(2)})["w"].device
        device(type='cpu')
    """
    return _apply(_apply(obj, torch.nn.Module, _module_to_cpu), torch.Tensor, _tensor_to_cpu)  # type: ignore[no-any-return]


def _is_shared(tensor: torch.Tensor) -> bool:
    """Whether a forked process would share the tensor's memory: torch shared memory, or a result mapped
    shared by mplaunch's transport (an ordinary tensor otherwise, ``is_shared()`` false)."""
    return tensor.is_shared() or in_shared_mapping(tensor.untyped_storage().data_ptr())


@torch.no_grad()
def _unshare_module(module: torch.nn.Module) -> torch.nn.Module:
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if _is_shared(tensor):
            tensor.data = tensor.data.clone()
    return module


def _unshare_array(array: Any) -> Any:
    """A copy of a NumPy array that lies in a result mapped shared, else the array itself."""
    return array.copy() if in_shared_mapping(array.__array_interface__["data"][0]) else array


def _unshare_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if not _is_shared(tensor):
        return tensor
    copy = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


#: Types that hold no tensor; a container of nothing else is skipped with one pass in C (``set(map(type, ...))``).
_LEAVES = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice})


def _unshare_any(obj: Any) -> Any:
    """The walk of :func:`unshare`: returns ``obj`` itself when nothing in it changed."""
    kind = type(obj)
    if kind in _LEAVES:
        return obj
    if isinstance(obj, torch.Tensor):
        return _unshare_tensor(obj)
    if isinstance(obj, torch.nn.Module):
        return _unshare_module(obj)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return _unshare_array(obj)
    if isinstance(obj, (list, tuple, set, frozenset)):
        if set(map(type, obj)) <= _LEAVES:
            return obj
        items = [_unshare_any(item) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return kind(*items)
        return kind(items)
    if isinstance(obj, Mapping):
        if set(map(type, obj.values())) <= _LEAVES:
            return obj
        values = {key: _unshare_any(value) for key, value in obj.items()}
        if all(values[key] is value for key, value in obj.items()):
            return obj
        copy = copy_module.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict, ...)
        copy.update(values)  # type: ignore[attr-defined]
        return copy
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            field.name: new
            for field in dataclasses.fields(obj)
            if field.init and (new := _unshare_any(old := getattr(obj, field.name))) is not old
        }
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


_BIG = 10_000  # elements: a container this long is not walked in every forked worker without a reason


def unshare_verdict(obj: Any) -> bool | None:
    """In the parent, before forking: whether forked workers must run :func:`unshare` on ``obj``, as far as
    ``obj`` alone tells: ``True``, ``False``, or ``None`` when it is large and the answer is whether this
    process maps shared memory (:func:`shared_mappings`, which a launch asks while its workers start).

    Walking a forked worker's arguments touches every element's reference count, which copies every page
    they live on (copy-on-write): 30 ms for a list of 10**6 ints, in each worker. So when ``obj`` is large (a
    container of more than 10,000 elements, or more than 10,000 objects in all), the walk happens only if this
    process has a writable shared memory mapping at all: a tensor can be in shared memory only then. Small
    arguments are walked here (it costs microseconds): made of plain values and containers only, they hold
    no tensor, and the workers skip the walk.
    """
    budget = _BIG
    pending = [obj]
    while pending:
        item = pending.pop()
        if type(item) in _LEAVES:
            continue
        if not isinstance(item, (list, tuple, set, frozenset, Mapping)):
            return True  # a tensor, a module, or an object that may hold one
        size = len(item)
        budget -= size
        if size > _BIG or budget < 0:
            return None
        pending.extend(item.values() if isinstance(item, Mapping) else item)
    return False


def shared_mappings(maps: str = "/proc/self/maps") -> bool:
    """Whether this process maps any memory shared and writable (``rw-s``); True when it cannot tell."""
    try:
        with open(maps, "rb") as file:
            text = file.read()
    except OSError:
        return True
    # the permissions column ("rw-s", "rwxs"); a path holding those words only costs a needless walk
    return b" rw-s " in text or b" rwxs " in text


def unshare(obj: T) -> T:
    """Give the calling process private copies of the tensors in ``obj`` that live in shared memory.

    Runs in a forked worker, on its arguments: a tensor in shared memory (``Tensor.is_shared()``, e.g. after
    ``Module.share_memory()`` in the parent, which ``fork`` keeps shared), or in the shared mapping of an
    earlier launch's result, is replaced by a private copy, and an ``nn.Module``'s parameters and buffers are
    re-pointed to copies in place, so an in-place update in one worker is seen neither by the others nor by
    the parent; so is a NumPy array of a result. Other tensors are left as they are (no copy; a
    forked worker's memory is already copy-on-write). It looks inside lists, tuples, named tuples, sets,
    mappings and dataclasses, and returns the very same object where nothing changed; ``bytes``, strings and
    containers of plain numbers and strings are passed over in one pass in C, so a 4 MiB ``bytes`` or a list
    of a million ints costs (almost) nothing. Costs one copy of each shared tensor. The idea, and the need for
    it with ``nn.Module``, come from Lightning Fabric's launcher.

    Args:
        obj: arguments of a worker's function: tensors, modules, or collections of them.

    Returns:
        The same structure, with no tensor in shared memory.
    """
    return _unshare_any(obj)  # type: ignore[no-any-return]
