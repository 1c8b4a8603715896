"""Does start-up grow with the size of a tensor argument beyond one copy of it? (issue: large arguments)

Usage::

    python benchmarks/large_args.py [--nprocs 8] [--megabytes 100] [--repeats 5]

For each start method where arguments are sent (forkserver; spawn with ``--spawn``), it times warm launches
of a function that returns at once, with a 1 KiB and with a ``--megabytes`` MiB float32 tensor argument, and
compares the difference with one copy of the tensor into shared memory measured in the same run. mplaunch
writes the argument once and every worker maps it copy-on-write, so the difference should stay near one
copy, whatever ``--nprocs`` is (a pipe per worker would add one copy per worker, written one after the other).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workers import noop_with  # noqa: E402
from mplaunch import parallel  # noqa: E402


def median_launch(nprocs: int, start_method: str, argument: torch.Tensor, repeats: int) -> float:
    launch = parallel(nprocs=nprocs, start_method=start_method, timeout=300)(noop_with)
    launch(argument)  # warm: the fork server is started, modules are imported
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        launch(argument)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def one_copy(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.empty_like(tensor).share_memory_().copy_(tensor)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spawn", action="store_true", help="also measure spawn (slow: each worker imports torch)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    small = torch.zeros(256)
    large = torch.zeros(options.megabytes * 2**20 // 4)
    copy = statistics.median(one_copy(large) for _ in range(3))
    print(f"one copy of {options.megabytes} MiB into shared memory: {copy * 1000:.0f} ms")
    for start_method in ["forkserver"] + (["spawn"] if options.spawn else []):
        base = median_launch(options.nprocs, start_method, small, options.repeats)
        with_large = median_launch(options.nprocs, start_method, large, options.repeats)
        extra = with_large - base
        verdict = "PASS" if extra <= 2 * copy else "MISS"
        print(
            f"{start_method:>10} nprocs={options.nprocs}: {base * 1000:.0f} ms with 1 KiB, {with_large * 1000:.0f} ms "
            f"with {options.megabytes} MiB: +{extra * 1000:.0f} ms = {extra / copy:.2f} copies  {verdict} (<= 2 copies)"
        )


if __name__ == "__main__":
    main()
