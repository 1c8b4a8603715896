"""mplaunch against the physical floor of a launch: ``python benchmarks/floor.py [--nprocs 2 8 32] [--rounds 20]``.

The floor is what any launcher must do for a warm ``fork`` launch of a trivial function: fork ``nprocs`` bare
children, rank 0 writes its pickled value to a pipe, the parent reads it and reaps every child. The same
process runs both, interleaved (floor, mplaunch, floor, ...), so that a busy machine slows both alike; the
ratio of the medians is what counts. The return path is timed with every rank returning a
``time.perf_counter()`` stamp (one clock for every process of the machine), from the last rank's ``return``
to the caller holding the values, the workers reaped. ``benchmarks/run.py`` runs this as its ``floor`` cell.
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402

NPROCS = (2, 8, 32)


def stamp() -> float:
    """The launched function: when it returns, on the machine-wide monotonic clock."""
    return time.perf_counter()


def bare_forks(nprocs: int, every_rank: bool = False) -> Any:
    """The floor: ``nprocs`` bare forked children; rank 0 (``every_rank``: each) pipes the pickle of
    :func:`stamp`; every child is reaped. Returns rank 0's value (``every_rank``: the list of all)."""
    read_end, write_end = os.pipe()
    pids = []
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            if rank == 0 or every_rank:
                os.write(write_end, pickle.dumps(stamp()))  # 9 bytes or so: one atomic write
            os._exit(0)
        pids.append(pid)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        values = [pickle.load(pipe) for _ in range(nprocs if every_rank else 1)]
    for pid in pids:
        os.waitpid(pid, 0)
    return values if every_rank else values[0]


def interleaved(launches: dict[str, Callable[[], Any]], count: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``launches``, interleaved, after one of each; and, where a call returns
    stamps, the seconds from the last stamp to the call returning (``<key>_return``)."""
    samples: dict[str, list[float]] = {}
    for index in range(count + 1):
        for key, launch in launches.items():
            started = time.perf_counter()
            returned = launch()
            held = time.perf_counter()
            if index:
                samples.setdefault(key, []).append(held - started)
                if isinstance(returned, list):
                    samples.setdefault(f"{key}_return", []).append(held - max(returned))
    return samples


def launches(nprocs: int, timeout: float = 300.0) -> dict[str, list[float]]:
    """The floor's launch and mplaunch's, warm, ``fork``, rank 0's value returned."""
    from mplaunch import parallel

    mplaunch = parallel(nprocs=nprocs, start_method="fork", timeout=timeout)(stamp)
    return {"floor": lambda: bare_forks(nprocs), "mplaunch": mplaunch}  # type: ignore[dict-item]


def return_paths(nprocs: int, timeout: float = 300.0) -> dict[str, Callable[[], Any]]:
    """The same, every rank returning its stamp (``return_all=True``): the return path runs from the last
    rank's ``return`` to the caller holding the values, every worker reaped."""
    from mplaunch import parallel

    mplaunch = parallel(nprocs=nprocs, start_method="fork", timeout=timeout, return_all=True)(stamp)
    return {"floor": lambda: bare_forks(nprocs, every_rank=True), "mplaunch": mplaunch}


def floor_parts(plan: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The ``floor`` cell of ``benchmarks/run.py``: one part per nprocs (fewer launches with more ranks),
    and the return path with 2 ranks."""
    parts: dict[str, Callable[[], Any]] = {
        f"fork {n}": functools.partial(_measure, launches, n, max(5, plan["warm"] * 8 // n)) for n in NPROCS
    }
    parts["return"] = functools.partial(_measure, return_paths, 2, plan["warm"] * 4)
    return parts


def _measure(make: Callable[[int], dict[str, Callable[[], Any]]], nprocs: int, count: int) -> dict[str, list[float]]:
    return interleaved(make(nprocs), count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=list(NPROCS))
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    import torch  # noqa: F401 - the floor and mplaunch fork the same process, torch imported

    for nprocs in args.nprocs:
        found = {k: median(v) or 0.0 for k, v in interleaved(launches(nprocs), args.rounds).items()}
        print(
            f"nprocs={nprocs:<3} floor {found['floor'] * 1e3:7.2f} ms  mplaunch {found['mplaunch'] * 1e3:7.2f} ms  "
            f"mplaunch/floor {found['mplaunch'] / found['floor']:.2f}x",
            flush=True,
        )
    found = {k: median(v) or 0.0 for k, v in interleaved(return_paths(2), args.rounds).items()}
    print(
        f"return path, nprocs=2: floor {found['floor_return'] * 1e3:.2f} ms, "
        f"mplaunch {found['mplaunch_return'] * 1e3:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
