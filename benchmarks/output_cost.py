"""What per-rank output routing costs a rank that writes a lot (issue: per-rank output).

Usage::

    python benchmarks/output_cost.py [--megabytes 100] [--line-bytes 100] [--repeats 3]

One rank prints ``--megabytes`` MiB of text, one ``print`` per line, to a console that is ``/dev/null`` (this
process's fd 1 is pointed there for the launches, so the console itself costs nothing and what is measured is
the routing): once with routing off (the worker writes to the inherited fd 1) and once with
``prefix_output=True`` (fd 1 is a pipe that the parent's thread drains, prefixes and writes). It prints, for
each, the time the rank spent writing (what routing makes the rank wait) and the whole launch, and the
ratios on/off. With routing on the worker's ``sys.stdout`` is line-buffered (a line reaches the parent when
it ends); with it off it is whatever Python chose (block-buffered for a file or pipe), so the ratio includes
one ``write`` system call per line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mplaunch import parallel  # noqa: E402


def write_text(megabytes: int, line_bytes: int) -> float:
    """In the worker: print ``megabytes`` MiB in lines of ``line_bytes`` bytes; return the seconds it took."""
    line = "x" * (line_bytes - 1)
    start = time.perf_counter()
    for _ in range(megabytes * 2**20 // line_bytes):
        print(line)
    sys.stdout.flush()
    return time.perf_counter() - start


def measure(prefix: bool, megabytes: int, line_bytes: int, repeats: int) -> tuple[float, float]:
    """Median (seconds the rank wrote, seconds the launch took)."""
    launch = parallel(nprocs=1, start_method="fork", timeout=600, prefix_output=prefix)(write_text)
    writes, totals = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        writes.append(launch(megabytes, line_bytes))
        totals.append(time.perf_counter() - start)
    return statistics.median(writes), statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--line-bytes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    report = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        results = {
            prefix: measure(prefix, options.megabytes, options.line_bytes, options.repeats) for prefix in (False, True)
        }
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    (off_write, off_total), (on_write, on_total) = results[False], results[True]
    size = options.megabytes
    print(f"rank writes {size} MiB in {options.line_bytes}-byte lines, console /dev/null", file=report)
    print(
        f"routing off: rank wrote in {off_write:.2f} s ({size / off_write:.0f} MiB/s), launch {off_total:.2f} s",
        file=report,
    )
    print(
        f"routing on:  rank wrote in {on_write:.2f} s ({size / on_write:.0f} MiB/s), launch {on_total:.2f} s",
        file=report,
    )
    print(f"ratio on/off: rank {on_write / off_write:.2f}x, launch {on_total / off_total:.2f}x", file=report)
    report.close()


if __name__ == "__main__":
    main()
