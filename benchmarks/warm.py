"""Warm workers and live values: ``python -m benchmarks.warm [START_METHOD ...]`` prints, per start method, the
median of a no-op ``Workers.run`` on 2 warm ranks (target: 2 ms or less), and the median delay from a
``yield`` in rank 0 to the value's arrival in the caller (target: 10 ms or less). Timings go to stdout only."""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import mplaunch

RUNS = 300


def noop() -> None:
    """The call whose round trip is measured."""


def stamps(count: int) -> Iterator[float]:
    """Yield ``time.monotonic()`` (one clock for every process of the machine) at each yield."""
    for _ in range(count):
        yield time.monotonic()
        time.sleep(0.001)


def measure_samples(start_method: str, runs: int) -> dict[str, list[float]]:
    """Every sample of :func:`measure`'s two figures (seconds), for the ``interactive`` cell of run.py."""
    with mplaunch.Workers(nprocs=2, start_method=start_method, timeout=600) as workers:  # type: ignore[arg-type]
        workers.run(noop)
        calls = []
        for _ in range(runs):
            start = time.perf_counter()
            workers.run(noop)
            calls.append(time.perf_counter() - start)
        delays = [time.monotonic() - stamp for stamp in workers.run(stamps, runs)]
    return {"run": calls, "yield": delays}


def interactive_parts(plan: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The ``interactive`` cell of ``benchmarks/run.py``: a no-op warm ``run()`` and a yield's delay (fork),
    and ``heartbeat()`` in a rank (seconds per call)."""
    from benchmarks.heartbeat import per_call

    runs = plan["warm"] * 25

    def beat() -> list[float]:
        return [mplaunch.parallel(nprocs=1, start_method="fork", timeout=120)(per_call)() * 1e-9]

    return {"warm": functools.partial(measure_samples, "fork", runs), "heartbeat": beat}


def main(start_methods: list[str]) -> None:
    for start_method in start_methods:
        found = measure_samples(start_method, RUNS)
        call, delay = statistics.median(found["run"]), statistics.median(found["yield"])
        print(
            f"{start_method:>10}: no-op run {call * 1e3:.2f} ms median (target <= 2 ms); "
            f"yield to arrival {delay * 1e3:.2f} ms median (target <= 10 ms)"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["fork", "forkserver", "spawn"])
