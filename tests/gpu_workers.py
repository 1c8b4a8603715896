"""Module-level worker functions of the GPU check (tests/gpu), importable by spawn and forkserver workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from mplaunch import worker_info


def _device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK``, shared round-robin when ranks outnumber devices."""
    return torch.device("cuda", worker_info().local_rank % torch.cuda.device_count())


def cuda_values(big_bytes: int) -> dict[str, Any]:
    """A tensor, a module and a ``big_bytes`` tensor, all on the GPU."""
    device = _device()
    big = torch.empty(big_bytes, dtype=torch.uint8, device=device)
    big.fill_(7)
    return {"tensor": torch.arange(4.0, device=device), "module": torch.nn.Linear(2, 2).to(device), "big": big}


def device_used_for(seconds: float) -> tuple[str | None, int, float, float]:
    """Hold this rank's device for ``seconds``: its ``CUDA_VISIBLE_DEVICES``, the devices it sees, the span."""
    started = time.time()
    held = torch.ones(1 << 20, device=_device())
    torch.cuda.synchronize()
    time.sleep(seconds)
    del held
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), started, time.time()


def ddp_step() -> dict[str, Any]:
    """One DDP step on CUDA tensors and an ``all_reduce`` of one (the launch's backend: gloo or nccl)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device, rank = _device(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    torch.manual_seed(rank)  # a different batch per rank: only the all-reduced gradients make them agree
    ddp(torch.randn(8, 4, device=device)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    summed = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    return {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "summed": summed,
        "weight": model.weight.detach(),
    }


def hold_then_oom(hold_bytes: int) -> None:
    """Rank 1 holds ``hold_bytes`` on the GPU, then asks for more than the GPU has; rank 0 waits."""
    if worker_info().rank != 1:
        time.sleep(300)
        return
    held = torch.empty(hold_bytes, dtype=torch.uint8, device=_device())
    held.fill_(1)
    torch.empty(2 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device=_device())


def hold_and_wait(hold_bytes: int, ready: str) -> None:
    """Hold ``hold_bytes`` on the GPU, write this pid to ``ready``, and wait to be killed."""
    held = torch.empty(hold_bytes, dtype=torch.uint8, device=_device())
    held.fill_(1)
    torch.cuda.synchronize()
    Path(ready).write_text(str(os.getpid()))
    signal.pause()


def stuck_in_synchronize() -> None:
    """Queue a GPU kernel that spins for a minute or more, then wait for it in ``torch.cuda.synchronize()``
    (the rank is killed meanwhile: the driver ends its kernel with its context)."""
    torch.cuda._sleep(120_000_000_000)  # clock cycles: 60 s at 2 GHz
    torch.cuda.synchronize()


def allocate(nbytes: int) -> int:
    """Allocate and fill ``nbytes`` on the GPU; return how many bytes it held."""
    held = torch.ones(nbytes // 4, device=_device())
    torch.cuda.synchronize()
    return int(held.numel() * 4)


def cuda_draw(seed: int) -> tuple[float, float]:
    """A draw from this rank's default CUDA generator, and one from a generator seeded with (``seed``, rank)."""
    from mplaunch._state.snapshot import derived_seed

    device = _device()
    generator = torch.Generator(device=device).manual_seed(derived_seed(seed, worker_info().rank))
    return torch.rand(1, device=device).item(), torch.rand(1, device=device, generator=generator).item()
