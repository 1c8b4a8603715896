"""The default process group that ``backend=`` sets up around the function, in a worker or in-process."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def process_group(backend: str | None, local_rank: int) -> Iterator[None]:
    """Hold a default process group (``env://``) around the block, or reuse an existing one; ``None``: none."""
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
    except ValueError as error:
        clear = clash(error, backend)
        if clear is None:
            raise
        raise clear from error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = hook


def clash(error: BaseException, backend: str | None) -> ValueError | None:
    """Return a ``ValueError`` naming the ways out if the function made ``backend=``'s group again, else ``None``."""
    if backend is None or not isinstance(error, ValueError) or "default process group twice" not in str(error):
        return None
    clear = ValueError(
        f"backend={backend!r} made mplaunch initialise the default process group before the function, which "
        f"initialised it again ({error}). Either leave out backend= and keep the function's init_process_group, "
        "or keep backend= and remove that call: the group is ready when the function starts."
    )
    clear.__cause__ = error
    return clear


_INHERITED: list[Any] = []  # torch.distributed's state copied from the parent at fork: kept, never destroyed


def forget_inherited_groups() -> None:
    """Drop the process groups a forked worker inherited (their threads did not survive the fork), never destroyed."""
    if not has_groups():
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    _INHERITED.append(getattr(c10d, "_world", None))
    setattr(c10d, "_world", c10d._World())  # noqa: B010 - a private name mypy does not know


def has_groups() -> bool:
    """Return whether this process has a default process group (asked by the parent before a fork)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return c10d is not None and hasattr(c10d, "_World") and bool(c10d.is_initialized())
