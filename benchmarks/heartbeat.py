"""``mplaunch.heartbeat()``: nanoseconds per call outside a launch (a no-op) and in a rank (one store into the
board shared with the parent), and the median of warm fork launches (what watching adds to a launch).

Run: ``python benchmarks/heartbeat.py`` (target: a beat under 1 µs, well under the issue's 1-2 µs).
"""

from __future__ import annotations

import statistics
import time

import mplaunch
from mplaunch import parallel

CALLS = 1_000_000


def per_call() -> float:
    """Nanoseconds per ``heartbeat()``, best of 5 runs of ``CALLS`` calls."""
    beat = mplaunch.heartbeat
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(CALLS):
            beat()
        best = min(best, (time.perf_counter_ns() - start) / CALLS)
    return best


def empty_loop() -> float:
    """Nanoseconds per iteration of the same loop calling nothing, to subtract."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(CALLS):
            pass
        best = min(best, (time.perf_counter_ns() - start) / CALLS)
    return best


def nothing() -> None:
    return None


def main() -> None:
    loop = empty_loop()
    print(f"heartbeat() outside a launch:  {per_call() - loop:6.0f} ns per call (loop overhead {loop:.0f} ns removed)")
    in_rank = parallel(nprocs=1, start_method="fork", timeout=120)(per_call)()
    print(f"heartbeat() in a rank:         {in_rank - loop:6.0f} ns per call")
    launch = parallel(nprocs=2, start_method="fork", timeout=120)(nothing)
    launch()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    print(f"warm fork launch (nprocs=2):   {statistics.median(times) * 1000:6.1f} ms median of 15")


if __name__ == "__main__":
    main()
