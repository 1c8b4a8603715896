"""Module-level worker functions for the exit-order and compatibility tests (importable by spawn/forkserver
workers)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
from typing import Any

import torch

from mplaunch import StartMethod, parallel


def _tracker_helper(connection: Any, path: str) -> None:
    """A tracker's helper process: on the rank's last message, write it to ``path`` and acknowledge."""
    message = connection.recv()
    with open(path, "w") as file:
        file.write(message)
    connection.send("saved")


def _finish_run(connection: Any) -> None:
    connection.send("final metrics")
    connection.recv()  # as a tracker's finish() waits for its helper


def tracker_at_exit(path: str) -> int:
    """Start a helper process and register an ``atexit`` handler that finishes the run through it."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    helper = multiprocessing.get_context("fork").Process(target=_tracker_helper, args=(theirs, path), daemon=True)
    helper.start()
    atexit.register(_finish_run, ours)
    return 7


def register_exit_mark(directory: str, ending: str) -> int:
    """Register an ``atexit`` handler that leaves ``rank-<pid>`` in ``directory``, then return 0, raise a
    ``ValueError`` or ``sys.exit(3)`` (``ending``)."""
    atexit.register(lambda: open(os.path.join(directory, f"rank-{os.getpid()}"), "w").close())
    if ending == "raise":
        raise ValueError("the rank's error")
    if ending == "sys.exit":
        raise SystemExit(3)
    return 0


def _exit(code: int) -> None:
    raise SystemExit(code)


class ExitsWhenPickled:
    """A result whose pickling raises ``SystemExit(3)``."""

    def __reduce__(self) -> Any:
        raise SystemExit(3)


class ExitsWhenUnpickled:
    """A result whose unpickling (in the parent) raises ``SystemExit(4)``."""

    def __reduce__(self) -> Any:
        return (_exit, (4,))


def result_exiting_when_pickled(path: str) -> Any:
    atexit.register(_write, path, "atexit ran")
    return ExitsWhenPickled()


def result_exiting_when_unpickled() -> Any:
    return ExitsWhenUnpickled()


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def add_one(module: torch.nn.Linear) -> bool:
    """The hogwild step: update the module's weight in place; returns whether it is shared here."""
    with torch.no_grad():
        module.weight.add_(1.0)
    return bool(module.weight.is_shared())


def pid() -> int:
    return os.getpid()


def ddp_setup(rank: int, world_size: int, port: int, **bounded: Any) -> None:
    """The PyTorch DDP tutorial's set-up (multigpu.py), on gloo and a free port (``bounded``: a ``timeout`` for
    a test that runs in the test process, where no launch timeout applies)."""
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group(backend="gloo", rank=rank, world_size=world_size, **bounded)


def tutorial_main(rank: int, world_size: int, port: int, **bounded: Any) -> float:
    """The tutorial's ``main(rank, world_size, ...)``: set up, one DDP step, destroy; returns the summed ranks.
    The model is deleted before the group is destroyed, as docs/guide/hangs.md advises: freed after it, torch's
    reducer can deadlock with gloo's threads (pytorch#56297), which a loaded machine hit in the suite."""
    ddp_setup(rank, world_size, port, **bounded)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(4, 2)).sum().backward()
    total = torch.tensor(float(rank + 1))
    torch.distributed.all_reduce(total)
    del model
    torch.distributed.destroy_process_group()
    return float(total.item())


def tutorial_in_rank(port: int, init_method: str | None = None, **bounded: Any) -> float:
    """The tutorial's set-up in a ``@parallel`` function: the rank is read from the environment."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if init_method is None:
        return tutorial_main(rank, world_size, port, **bounded)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    total = torch.tensor(float(rank + 1))
    torch.distributed.all_reduce(total)
    torch.distributed.destroy_process_group()
    return float(total.item())


def index_and_args(index: int, *args: Any) -> tuple[int, int, tuple[Any, ...]]:
    return index, int(os.environ["RANK"]), args


def hogwild_train(index: int, model: torch.nn.Module, turn: torch.Tensor) -> bool:
    """mnist_hogwild's ``train(rank, args, model, ...)`` shape: update the model in place. The ranks take
    turns through ``turn`` (shared), so that no update is lost; returns whether the model is shared here."""
    while int(turn.item()) != index:
        time.sleep(0.001)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    turn.add_(1)
    return all(parameter.is_shared() for parameter in model.parameters())


def _launch_in(start_method: StartMethod) -> tuple[int, int]:
    return parallel(nprocs=1, start_method=start_method, timeout=60)(pid)(), os.getpid()


def launch_from_pool_worker(start_method: StartMethod) -> tuple[int, int, bool]:
    """What a trial of a hyper-parameter search does in a ``multiprocessing.Pool`` worker: launch."""
    worker, here = _launch_in(start_method)
    return worker, here, bool(multiprocessing.current_process().daemon)


@parallel(nprocs=1, start_method="fork", timeout=60)
def double_in_a_rank(x: int) -> tuple[int, int]:
    """A module-level decorated function, for runners that pickle it (ProcessPoolExecutor)."""
    return 2 * x, int(os.environ["RANK"])


def _touch_and_sleep(path: str) -> None:
    with open(path, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(60)


def launch_sleeper(path: str, start_method: StartMethod) -> None:
    parallel(nprocs=1, start_method=start_method, timeout=90)(_touch_and_sleep)(path)


def _inner_sum(own_group: bool) -> float:
    if own_group:
        torch.distributed.init_process_group("gloo")
    total = torch.tensor(float(int(os.environ["RANK"]) + 1))
    torch.distributed.all_reduce(total)
    if own_group:
        torch.distributed.destroy_process_group()
    return float(total.item())


def nested_fork_launch_in_a_gloo_rank(backend: str | None) -> tuple[float, float]:
    """In a rank with a gloo group of its own, a fork launch of 2 ranks: they make their group themselves
    (``backend=None``) or through ``backend=``."""
    torch.distributed.init_process_group("gloo")
    outer = torch.tensor(1.0)
    torch.distributed.all_reduce(outer)
    os.environ["MPLAUNCH_IN_PROCESS"] = "0"
    try:
        inner = parallel(nprocs=2, start_method="fork", timeout=40, backend=backend)(_inner_sum)(backend is None)
    finally:
        del os.environ["MPLAUNCH_IN_PROCESS"]
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return float(outer.item()), inner
