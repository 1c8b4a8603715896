"""Functions the benchmark runs in worker processes.

They are module-level (``spawn`` and ``forkserver`` workers import them by name) and live in a module that
imports only ``torch`` and the standard library, so every launcher's workers pay the same import cost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

#: Result payloads of benchmark (b): name -> size in bytes of the tensor, or ``None`` for non-tensors.
PAYLOAD_BYTES: dict[str, int | None] = {
    "int": None,
    "list 10**6 ints": None,
    "1 MiB tensor": 1 << 20,
    "64 MiB tensor": 64 << 20,
    "512 MiB tensor": 512 << 20,
}


def trivial() -> None:
    """Benchmark (a): do nothing, so a launch costs only what the launcher adds."""


def gloo_cycle() -> None:
    """Benchmark (c): set up a gloo process group from the torchrun-style environment, all-reduce one number,
    tear the group down. Under launchers that set the group up themselves (Fabric, Ignite) only the
    all-reduce runs."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    try:
        value = torch.ones(1)
        dist.all_reduce(value)
        if value.item() != dist.get_world_size():
            raise RuntimeError(f"all_reduce gave {value.item()}, expected {dist.get_world_size()}")
    finally:
        if owned:
            dist.destroy_process_group()


def build_payload(kind: str) -> Any:
    """The value of payload ``kind`` (a key of :data:`PAYLOAD_BYTES`)."""
    if kind == "int":
        return 42
    if kind == "list 10**6 ints":
        return list(range(10**6))
    nbytes = PAYLOAD_BYTES[kind]
    if nbytes is None:
        raise ValueError(f"unknown payload {kind!r}")
    return torch.ones(nbytes // 4, dtype=torch.float32)


def make_payload(kind: str) -> tuple[float, Any]:
    """Benchmark (b): build payload ``kind`` in rank 0 and return ``(time.time() when it was ready, payload)``.

    Other ranks return ``(time, None)`` without building it, so only one copy exists.
    """
    value = build_payload(kind) if _rank() == 0 else None
    return time.time(), value


def stamp() -> float:
    """For the profile: the wall-clock time at which the function started in the worker."""
    return time.time()


def drop_first(function: Callable[..., Any], _first: Any, *args: Any) -> Any:
    """Adapter for launchers that pass something first (Fabric passes itself, Ignite the local rank)."""
    return function(*args)


def with_rank_env(
    function: Callable[..., Any], master_addr: str, master_port: int, world_size: int, rank: int, *args: Any
) -> Any:
    """Adapter for raw ``torch.multiprocessing``: set the variables that ``init_process_group`` reads (what a
    user of ``start_processes`` writes by hand), then call ``function``."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    return function(*args)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def noop_with(argument: Any) -> None:
    """Return at once: what a launch with this argument costs is the start-up alone."""
