"""The default process group that ``backend=`` sets up around the function, in a worker or in-process."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def process_group(backend: str | None, local_rank: int) -> Iterator[None]:
    """Initialise the default process group from the torchrun environment (``init_method="env://"``) around
    the block, and destroy it after, also when the block raises; ``sys.excepthook``, which torch replaces
    when it makes the group, is put back. ``None``: nothing is done; a process group
    that already exists is kept as it is (a nested call reuses its caller's).

    Raises:
        RuntimeError: ``backend="nccl"`` and this process sees no CUDA device.
    """
    if backend is None:  # (before the import: a worker without a group pays nothing here)
        yield
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    if backend == "nccl":
        if torch.cuda.device_count() == 0:
            raise RuntimeError("backend='nccl' needs CUDA devices, and this worker sees none; use backend='gloo'")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    hook = sys.excepthook  # init_process_group installs torch's "[rankN]:" hook; it goes with the group
    dist.init_process_group(backend)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = hook


_INHERITED: list[Any] = []  # torch.distributed's state copied from the parent at fork: kept, never destroyed


def forget_inherited_groups() -> None:
    """In a forked worker: drop the process groups copied from the parent (a rank with a group of its own
    that launches under ``fork``). They are not this process's: the threads of their backend (gloo, the
    store's client) did not survive the fork, so a collective on them, or ``backend=`` reusing them, would
    wait forever, and ``init_process_group`` would refuse to make one ("initialize the default process group
    twice"). Their state is replaced by a fresh one (``distributed_c10d._world``, torch's extension point for
    it) and kept alive, not destroyed: destroying would close connections the parent still uses."""
    if not has_groups():
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    _INHERITED.append(getattr(c10d, "_world", None))
    setattr(c10d, "_world", c10d._World())  # noqa: B010 - a private name mypy does not know


def has_groups() -> bool:
    """Whether this process has a default process group (a forked worker inherits it, see
    :func:`forget_inherited_groups`); asked by the parent before the fork, so that the worker does not."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return c10d is not None and hasattr(c10d, "_World") and bool(c10d.is_initialized())
