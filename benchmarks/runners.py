"""The launchers under test, as one table.

Each :class:`Runner` knows how to run a function from :mod:`benchmarks.workers` on two processes of this
machine with one of its start methods, and returns rank 0's value where the launcher gives one back.
Peers come from an optional extra; a runner whose package is missing reports why and is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks import workers

NPROCS = 2

Launch = Callable[[str, Callable[..., Any], tuple[Any, ...], float], Any]


@dataclasses.dataclass(frozen=True)
class Runner:
    """One launcher.

    Attributes:
        key: short name used on the command line and in the JSON.
        label: name shown in the table and chart.
        methods: the start methods (or variants) it is measured with.
        launch: ``(method, function, args, timeout) -> rank 0's value or None``.
        module: what the launcher needs imported; imported before the first timed launch, so that import
            time is not counted as launch time.
        optional: ``module`` comes from the optional ``bench`` extra (a peer); skipped when missing.
        payload_method: the method used for result-return benchmark (b), or ``None`` when the launcher
            does not return values.
        payload_skip: payloads of (b) not attempted, with the reason (a known hang).
        own_process_group: the launcher always sets up a process group itself, so it has no trivial launch.
        slow_methods: methods where every worker imports torch afresh (seconds per launch): fewer repeats.
    """

    key: str
    label: str
    methods: tuple[str, ...]
    launch: Launch
    module: str
    optional: bool = False
    payload_method: str | None = None
    payload_skip: dict[str, str] = dataclasses.field(default_factory=dict)
    own_process_group: bool = False
    slow_methods: tuple[str, ...] = ("spawn",)

    @property
    def peer(self) -> bool:
        """Another launcher (not the raw torch baseline, not mplaunch)."""
        return self.key not in ("raw", "mplaunch")

    def missing(self) -> str | None:
        """Why this runner cannot run here, or ``None``."""
        top = self.module.partition(".")[0]
        if not self.optional or importlib.util.find_spec(top) is not None:
            return None
        return f"{top!r} is not installed (pip install -e '.[bench]')"

    def prepare(self) -> None:
        """Import what the launcher needs."""
        importlib.import_module(self.module)


def free_port() -> int:
    """A TCP port that is free right now (what a user of a raw launcher picks by hand)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch_mplaunch(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    from mplaunch import parallel

    return parallel(nprocs=NPROCS, start_method=method, timeout=timeout)(function)(*args)


def _launch_raw(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    """``torch.multiprocessing.start_processes``; ``forkserver+preload`` preloads torch in the fork server."""
    import torch.multiprocessing as mp

    start_method, _, preload = method.partition("+")
    if preload:
        mp.get_context(start_method).set_forkserver_preload(["torch"])
    target = functools.partial(workers.with_rank_env, function, "127.0.0.1", free_port(), NPROCS)
    context = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        target, args=args, nprocs=NPROCS, start_method=start_method, join=False
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"torch.multiprocessing workers did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def _launch_elastic(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """``torch.distributed.launcher.api.elastic_launch`` as ``torchrun --standalone`` configures it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=NPROCS,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        return elastic_launch(config, function)(*args)[0]


def _launch_accelerate(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    """Accelerate's ``notebook_launcher`` (it always forks, through ``elastic_launch``). It leaves a
    ``torchelastic_*`` log directory in the temporary directory per launch, so it gets one of its own."""
    from accelerate import notebook_launcher

    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="bench-accelerate-") as logs:
        tempfile.tempdir = logs
        try:
            notebook_launcher(function, args=args, num_processes=NPROCS, use_port=str(free_port()))
        finally:
            tempfile.tempdir = previous


def _launch_fabric(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """Lightning ``Fabric(strategy="ddp_fork"/"ddp_spawn").launch``; it sets up a gloo group in every worker."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=NPROCS, strategy=f"ddp_{method}")
    return fabric.launch(functools.partial(workers.drop_first, function), *args)


def _launch_ignite(method: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    """Ignite ``idist.Parallel(backend="gloo")``; it sets up a gloo group in every worker."""
    import ignite.distributed as idist

    with idist.Parallel(backend="gloo", nproc_per_node=NPROCS, start_method=method) as parallel:  # type: ignore[attr-defined]
        parallel.run(functools.partial(workers.drop_first, function), *args)


_FABRIC_PIPE = (
    "not attempted: Fabric's launcher joins the workers before reading rank 0's result from a pipe, so a "
    "result larger than the pipe buffer (64 KiB) deadlocks"
)

RUNNERS: tuple[Runner, ...] = (
    Runner(
        "raw",
        "torch.mp (raw)",
        ("fork", "forkserver", "forkserver+preload", "spawn"),
        _launch_raw,
        "torch.multiprocessing",
        slow_methods=("forkserver", "spawn"),
    ),
    Runner(
        "mplaunch",
        "mplaunch",
        ("fork", "forkserver", "spawn"),
        _launch_mplaunch,
        "mplaunch",
        payload_method="fork",
    ),
    Runner(
        "elastic",
        "elastic_launch",
        ("fork", "spawn"),
        _launch_elastic,
        "torch.distributed.launcher.api",
        payload_method="fork",
    ),
    Runner("accelerate", "accelerate", ("fork",), _launch_accelerate, "accelerate", optional=True),
    Runner(
        "fabric",
        "Fabric",
        ("fork", "spawn"),
        _launch_fabric,
        "lightning.fabric",
        optional=True,
        payload_method="fork",
        payload_skip={"list 10**6 ints": _FABRIC_PIPE},
        own_process_group=True,
    ),
    Runner(
        "ignite",
        "ignite",
        ("fork", "spawn"),
        _launch_ignite,
        "ignite.distributed",
        optional=True,
        own_process_group=True,
    ),
)

BY_KEY = {runner.key: runner for runner in RUNNERS}
