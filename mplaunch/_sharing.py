"""Moving results to the CPU."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from lightning_utilities import apply_to_collection

T = TypeVar("T")


def _module_to_cpu(module: torch.nn.Module) -> torch.nn.Module:
    return module.cpu()


def _tensor_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu()


def to_cpu(obj: T) -> T:
    """Return ``obj`` with every tensor on the CPU, recursing into dicts, lists, tuples, named tuples and
    dataclasses (``lightning_utilities.apply_to_collection``).

    Tensors already on the CPU are returned as they are (no copy); other tensors are copied. An
    ``nn.Module`` is moved in place with ``Module.cpu()``. Tensors held by other objects are copied to the
    CPU when the result is serialised, so they arrive on the CPU too.

    Args:
        obj: any object; typically a ``state_dict`` or a nested collection of tensors.

    Returns:
        The same structure with CPU tensors.

    Example:
        >>> to_cpu({"w": torch.ones(2)})["w"].device
        device(type='cpu')
    """
    result: Any = apply_to_collection(obj, torch.nn.Module, _module_to_cpu)
    return apply_to_collection(result, torch.Tensor, _tensor_to_cpu)  # type: ignore[no-any-return]
