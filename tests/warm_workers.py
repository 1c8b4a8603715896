"""Module-level functions for the warm-worker and stream tests (importable by spawn/forkserver workers)."""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterator
from typing import Any

from mplaunch import worker_info

counter = 0


def bump() -> tuple[int, int, int]:
    """Add one to this rank's module global; return (rank, pid, the global)."""
    global counter
    counter += 1
    return worker_info().rank, os.getpid(), counter


def rank_and_pid() -> tuple[int, int]:
    return worker_info().rank, os.getpid()


def raise_in_rank(rank: int) -> int:
    if worker_info().rank == rank:
        raise ValueError(f"rank {rank} fails")
    return worker_info().rank


def exit_in_rank(rank: int, code: int) -> None:
    if worker_info().rank == rank:
        os._exit(code)


def wait_for(path: str, started: str | None = None) -> str:
    """Say it started (create ``started``), then wait until ``path`` exists."""
    if started is not None and worker_info().rank == 0:
        open(started, "w").close()
    while not os.path.exists(path):
        time.sleep(0.01)
    return "seen"


def sleep_forever(started: str) -> None:
    open(f"{started}{worker_info().rank}", "w").close()
    while True:
        time.sleep(0.05)


def values_then_wait(path: str) -> Generator[int, None, int]:
    """Rank 0 yields 1, then waits for ``path`` (created by the test once it has received 1), then yields 2."""
    yield 1
    while not os.path.exists(path):
        time.sleep(0.01)
    yield 2
    return 3


def pids_forever() -> Iterator[int]:
    while True:
        yield os.getpid()
        time.sleep(0.01)


def values_then_raise() -> Iterator[int]:
    """Every rank yields 1 and 2; then rank 0 raises."""
    yield 1
    yield 2
    if worker_info().rank == 0:
        raise ValueError("after two values")


def ranked_values(count: int) -> Generator[int, None, int]:
    for index in range(count):
        yield worker_info().rank * 100 + index
    return worker_info().rank


def say(word: str) -> None:
    """Print without a newline (a partial line), as a progress bar does."""
    print(f"{word} from rank {worker_info().rank}", end="")


def all_reduce_once() -> tuple[int, int]:
    """Sum rank + 1 over the process group that the workers keep; return (sum, id of the group)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([worker_info().rank + 1])
    dist.all_reduce(value)
    return int(value.item()), id(dist.group.WORLD)


def large_tensors(count: int) -> Iterator[object]:
    """Yield ``count`` tensors of 1 MiB (through the data file, not inside the pickle), each filled with its index."""
    import torch

    for index in range(count):
        yield torch.full((256 * 1024,), float(index))


calls: list[object] = []


def record(tag: object) -> list[object]:
    """Note ``tag`` in this rank's list of calls; return the list so far."""
    calls.append(tag)
    return list(calls)


_kept: dict[str, object] = {}  # what calls leave in a rank, by name
KEPT_WORKERS: Any = None  # Workers a rank forked after this was set inherits


def keep(name: str, value: object) -> None:
    _kept[name] = value


def read_kept(name: str) -> object:
    return _kept[name]


def call_workers(workers: Any) -> Any:
    return workers.run(rank_and_pid)


def call_kept_workers() -> Any:
    return KEPT_WORKERS.run(rank_and_pid)


def _note(marks: str, what: str) -> None:
    with open(os.path.join(marks, f"{what}{worker_info().rank}"), "w") as file:
        file.write(str(os.getpid()))


def hold_with_clean_up(marks: str, stuck: bool = False) -> None:
    """Note in ``marks`` that the call started, and then its ``finally`` block and an exit handler when the rank
    is stopped; ``stuck``: the ``finally`` block never ends."""
    for _ in stream_with_clean_up(marks, stuck):
        pass


def stream_with_clean_up(marks: str, stuck: bool = False) -> Iterator[int]:
    """As :func:`hold_with_clean_up`, yielding the rank every 50 ms."""
    import atexit

    atexit.register(_note, marks, "atexit")
    _note(marks, "started")
    try:
        while True:
            yield worker_info().rank
            time.sleep(0.05)
    finally:
        _note(marks, "finally")
        while stuck:
            time.sleep(0.05)
