"""The ``gpu`` cell of ``benchmarks/run.py`` (no parts without a CUDA device; its rows then read N/A).

- ``spawn``: a spawn launch of 2 ranks that each initialise CUDA (a tensor on ``cuda:LOCAL_RANK``, shared
  round-robin), against ``torch.multiprocessing.spawn`` doing the same, alternated.
- ``result``: a 1 GiB CUDA tensor returned by rank 0, from ready in the rank to the call returning here, against
  what the rank measured first: ``t.cpu()`` plus one copy into shared memory, the least a transfer costs.

This process never initialises CUDA: it counts the devices through NVML (``torch.cuda.device_count()``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import one_copy_seconds, timed

NPROCS = 2
TIMEOUT = 300.0


def cuda_rank(index: int = 0) -> None:
    """In a rank: initialise CUDA on this rank's device."""
    import torch

    torch.ones(1, device=f"cuda:{index % torch.cuda.device_count()}")
    torch.cuda.synchronize()


def _mplaunch_rank() -> None:
    from mplaunch import worker_info

    cuda_rank(worker_info().local_rank)


def cuda_result(nbytes: int) -> tuple[float, float, Any]:
    """In rank 0: a ``nbytes`` CUDA tensor, the seconds of ``t.cpu()`` plus one shared-memory copy of it, and
    ``time.time()`` when it is ready to return."""
    import torch

    tensor = torch.ones(nbytes // 4, device="cuda")
    torch.cuda.synchronize()
    [cpu_seconds], host = timed(tensor.cpu)
    baseline = cpu_seconds + one_copy_seconds(host, 1)[0]
    del host
    return baseline, time.time(), tensor


def spawn_launches(count: int) -> dict[str, list[float]]:
    """Spawn launches whose ranks initialise CUDA: mplaunch's and ``torch.multiprocessing.spawn``'s, in turn."""
    import torch.multiprocessing as mp

    from mplaunch import parallel

    runs: dict[str, Callable[[], Any]] = {
        "mplaunch": parallel(nprocs=NPROCS, start_method="spawn", timeout=TIMEOUT)(_mplaunch_rank),
        "raw": lambda: mp.spawn(cuda_rank, nprocs=NPROCS),  # type: ignore[no-untyped-call]
    }
    samples: dict[str, list[float]] = {key: [] for key in runs}
    for index in range(count + 1):  # the first of each warms the caches: not kept
        for key, run in runs.items():
            samples[key] += timed(run, timeout=TIMEOUT)[0] if index else []
    return samples


def result_returns(count: int) -> list[dict[str, float]]:
    """Launches returning a 1 GiB CUDA tensor: ``ret`` (ready in rank 0 -> returned here) and ``base``."""
    from mplaunch import parallel

    run = parallel(nprocs=1, start_method="spawn", timeout=TIMEOUT)(cuda_result)
    samples = []
    for _ in range(count):
        wall = time.time()
        [seconds], (base, ready, tensor) = timed(lambda: run(1 << 30), timeout=TIMEOUT)
        samples.append({"ret": wall + seconds - ready, "base": base})
        del tensor
    return samples


def gpu_parts(plan: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The cell's parts: none without a CUDA device."""
    import torch

    if not torch.cuda.device_count():
        return {}
    return {
        "spawn": functools.partial(spawn_launches, plan["repeats"] + 1),  # (+1: the quick plan has 1)
        "result": functools.partial(result_returns, plan["payload"]),
    }
