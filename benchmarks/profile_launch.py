"""Where a warm mplaunch launch spends its time, per source file: ``python benchmarks/profile_launch.py
[--launches N] [--methods fork forkserver spawn]`` (nprocs=2, a function that does nothing).

Per method: when the ranks enter the function and when the call returns (``return_all=True`` stamps), then
cProfile of the parent over N launches with each file's own time (a built-in's time, such as a ``poll`` or a
``fork``, counts for the file that called it), and under fork the same for the workers: a fork hook starts a
profiler in each child and the launched function registers its dump for the worker's exit. Files are named,
not functions, so nothing depends on mplaunch's private names.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median  # noqa: E402

WORKERS: dict[str, Any] = {}  # "directory" for worker profiles while they are collected; "profiler" in a worker


def start_child_profile() -> None:
    if "directory" in WORKERS:
        WORKERS["profiler"] = cProfile.Profile()
        WORKERS["profiler"].enable()


def profiled(*_: Any) -> float:
    """The launched function: have the profiler started at fork written out at the worker's exit."""
    if "profiler" in WORKERS:
        path, profiler = os.path.join(WORKERS["directory"], f"{os.getpid()}.prof"), WORKERS["profiler"]
        atexit.register(lambda: (profiler.disable(), profiler.dump_stats(path)))
    return time.time()


def source(file: str) -> str:
    """``mplaunch/_x.py``, a standard library module (``multiprocessing/connection.py``) or a package name."""
    path = file.replace("\\", "/")
    if "/mplaunch/" in path:
        return "mplaunch/" + path.rsplit("/mplaunch/", 1)[1]
    if "-packages/" in path:
        return path.rsplit("-packages/", 1)[1].split("/")[0] + " (package)"
    if "/lib/python3" in path:
        return path.rsplit("/lib/python3", 1)[1].split("/", 1)[-1]
    return "built-ins, called from built-ins" if file == "~" else os.path.basename(path)


def by_file(stats: pstats.Stats, per: int, title: str) -> list[str]:
    """The 12 files with the most own time, in ms per launch or worker (``per`` of them)."""
    totals: Counter[str] = Counter()
    for (file, _, _), (_, _, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file != "~":
            totals[source(file)] += own
        for (caller, _, _), timing in callers.items() if file == "~" else ():
            totals[source(caller)] += timing[2]
    whole = sum(totals.values()) or 1.0
    rows = [f"    {s / per * 1e3:8.2f} ms {s / whole:5.0%}  {name}" for name, s in totals.most_common(12)]
    return [f"  {title}: own time per file", *rows]


def report(method: str, launches: int) -> list[str]:
    from mplaunch import parallel

    stamps, times = parallel(nprocs=2, start_method=method, return_all=True, timeout=120)(profiled), []
    for _ in range(launches + 1):
        start = time.time()
        entered = stamps()
        times.append((min(entered) - start, max(entered) - start, time.time() - max(entered)))
    first, last, end = (median(row[i] for row in times[1:]) * 1e3 for i in range(3))  # type: ignore[operator]
    lines = [f"== mplaunch {method}, warm, nprocs=2, medians: the ranks enter the function {first:.1f} and",
             f"   {last:.1f} ms after the call starts; it returns {end:.1f} ms later"]  # fmt: skip
    profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="mplaunch-profile-") as directory:
        WORKERS["directory"] = directory
        profiler.runcall(lambda: [stamps() for _ in range(launches)])
        del WORKERS["directory"]
        lines += by_file(pstats.Stats(profiler), launches, f"parent, ms per launch of {launches}")
        files = [os.path.join(directory, name) for name in os.listdir(directory)]
        if files:
            lines += by_file(pstats.Stats(*files), len(files), f"workers, ms per worker of {len(files)}")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--methods", nargs="+", default=["fork", "forkserver"], choices=["fork", "forkserver", "spawn"])
    args = parser.parse_args()
    os.register_at_fork(after_in_child=start_child_profile)
    for method in args.methods:
        print("\n".join(report(method, args.launches)), flush=True)
