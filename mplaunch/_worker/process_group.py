"""The default process group that ``backend=`` sets up around the function, in a worker or in-process."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

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
    import torch.distributed as dist

    if backend is None or dist.is_initialized():
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
