"""The launchers under test as one table, and the functions their workers run (module-level, in a module that
imports only torch and the standard library, so every launcher's workers pay the same import cost; a peer is
imported in its launch function)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

NPROCS = 2
#: Result payloads: name -> size (the int itself, the list's length, the buffer's bytes; see :func:`size`).
PAYLOADS = {"int": 42, "list 10**6 ints": 10**6, "1 MiB tensor": 1 << 20, "64 MiB tensor": 64 << 20,
            "512 MiB tensor": 512 << 20, "400 MB NumPy array": 400 * 10**6}  # fmt: skip


def trivial(*_: Any) -> None:
    """Do nothing, so a launch costs only what the launcher adds (and the arguments, if any)."""


def gloo_cycle() -> None:
    """Set up a gloo group from the torchrun-style environment, all-reduce one number, tear the group down
    (under Fabric and Ignite, which set the group up themselves, only the all-reduce)."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    if value.item() != dist.get_world_size():
        raise RuntimeError(f"all_reduce gave {value.item()}, expected {dist.get_world_size()}")
    if owned:
        dist.destroy_process_group()


def build_payload(kind: str) -> Any:
    if kind.endswith("array"):
        import numpy

        return numpy.ones(PAYLOADS[kind], dtype=numpy.uint8)
    if kind.endswith("tensor"):
        return torch.ones(PAYLOADS[kind] // 4)
    return list(range(PAYLOADS[kind])) if kind.startswith("list") else PAYLOADS[kind]


def size(value: Any) -> Any:
    return value.nbytes if hasattr(value, "nbytes") else len(value) if isinstance(value, list) else value


def make_payload(kind: str) -> tuple[float, Any]:
    """Build payload ``kind`` in rank 0 (other ranks return None) and return ``(time.time() when ready, it)``."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    payload = build_payload(kind) if rank == 0 else None
    return time.time(), payload  # ready once built (a tuple display would read the clock before building)


def drop_first(function: Callable[..., Any], _first: Any, *args: Any) -> Any:
    """Adapter for launchers that pass something first (Fabric passes itself, Ignite the local rank)."""
    return function(*args)


def with_rank_env(function: Callable[..., Any], port: int, rank: int, *args: Any) -> Any:
    """Adapter for raw ``torch.multiprocessing``: set what ``init_process_group`` reads, as its users do."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(NPROCS))
    return function(*args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@functools.cache
def _decorated(method: str, function: Callable[..., Any], timeout: float) -> Callable[..., Any]:
    """Decorated once, as a user decorates a function once and calls it many times."""
    from mplaunch import parallel

    return parallel(nprocs=NPROCS, start_method=method, timeout=timeout)(function)


def launch_mplaunch(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    return _decorated(method, function, timeout)(*args)


def launch_raw(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    """``torch.multiprocessing.start_processes``; ``forkserver+preload`` preloads torch in the fork server."""
    import torch.multiprocessing as mp

    start_method, _, preload = method.partition("+")
    if preload:
        mp.get_context(start_method).set_forkserver_preload(["torch"])
    target = functools.partial(with_rank_env, function, free_port())
    mp.start_processes(target, args=args, nprocs=NPROCS, start_method=start_method)  # type: ignore[no-untyped-call]


def launch_elastic(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """``elastic_launch`` configured as ``torchrun --standalone`` configures it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as logs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=NPROCS, run_id=uuid.uuid4().hex, max_restarts=0,
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", start_method=method,
                              logs_specs=DefaultLogsSpecs(log_dir=logs))  # fmt: skip
        return elastic_launch(config, function)(*args)[0]


def launch_accelerate(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    """``notebook_launcher`` (always fork); it leaves a log directory per launch in the temporary directory."""
    from accelerate import notebook_launcher

    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="bench-accelerate-") as logs:
        tempfile.tempdir = logs
        try:
            notebook_launcher(function, args=args, num_processes=NPROCS, use_port=str(free_port()))
        finally:
            tempfile.tempdir = previous


def launch_fabric(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=NPROCS, strategy=f"ddp_{method}")
    return fabric.launch(functools.partial(drop_first, function), *args)


def launch_ignite(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    import ignite.distributed as idist

    with idist.Parallel(backend="gloo", nproc_per_node=NPROCS, start_method=method) as parallel:  # type: ignore
        parallel.run(functools.partial(drop_first, function), *args)


@dataclasses.dataclass(frozen=True)
class Runner:
    """One launcher, run by ``launch_<key>(method, function, args, timeout)`` (rank 0's value or None).
    ``module`` is imported before the first timed launch. ``payloads``: the method used for result return
    (empty: it returns no value); ``skip``: payloads not attempted (Fabric joins its workers before reading
    rank 0's result: a list deadlocks its pipe, a tensor's shared file descriptor is gone). ``own_group``: it
    always sets a process group up (no trivial launch). ``slow``: methods where every worker imports torch."""

    key: str
    label: str
    methods: str
    module: str
    payloads: str = ""
    skip: str = ""
    own_group: bool = False
    slow: str = "spawn"

    @property
    def peer(self) -> bool:
        return self.key not in ("raw", "mplaunch")

    def launch(self, method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        return globals()[f"launch_{self.key}"](method, function, args, timeout)

    def missing(self) -> str | None:
        top = self.module.partition(".")[0]
        return None if importlib.util.find_spec(top) else f"{top!r} is not installed (pip install -e '.[bench]')"


RUNNERS = (  # key, label, methods, module to import first, then: payloads, skip, own_group, slow
    Runner("raw", "torch.mp (raw)", "fork forkserver forkserver+preload spawn", "torch", slow="forkserver spawn"),
    Runner("mplaunch", "mplaunch", "fork forkserver spawn", "mplaunch", payloads="fork"),
    Runner("elastic", "elastic_launch", "fork spawn", "torch.distributed.launcher.api", payloads="fork"),
    Runner("accelerate", "accelerate", "fork", "accelerate"),
    Runner("fabric", "Fabric", "fork spawn", "lightning.fabric", "fork", "list tensor array", own_group=True),
    Runner("ignite", "ignite", "fork spawn", "ignite.distributed", own_group=True),
)  # fmt: skip
BY_KEY = {runner.key: runner for runner in RUNNERS}
