"""Where the time of a warm mplaunch launch goes (fork and forkserver, nprocs=2, a function that does nothing).

Usage::

    python benchmarks/profile_launch.py [--launches N] [--methods fork forkserver]

Four views, each after one warm-up launch:

* raw ``torch.multiprocessing.start_processes`` in the same process, for scale (under forkserver it uses
  the fork server mplaunch started, which has torch preloaded);
* a timeline from both sides: the parent notes when the call starts and returns, every rank returns
  ``time.time()`` from its first line (``return_all=True``), so the launch splits into
  start -> rank entered the function -> call returned;
* cProfile of the parent over ``N`` launches: the inclusive time per launch of mplaunch's steps. Time the
  parent spends blocked on its workers shows up as ``connection.wait``;
* cProfile of the workers: mplaunch's worker entry point (``mplaunch._launcher.run``) is swapped for a
  profiled wrapper for ``N`` more launches, and the steps inside it are timed per worker.

The heaviest functions are written to ``benchmarks/results/profile-<method>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import workers  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

#: (label, part of the file's path, function name): the parent's steps of a launch whose inclusive time is
#: reported. mplaunch's steps are found by name in any of its modules, so they survive moving code around.
STEPS = (
    ("whole call", "mplaunch/", "launch"),
    ("pre-launch checks: main guard", "mplaunch/", "check_main_guard"),
    ("thread-count check", "mplaunch/", "_num_threads"),
    ("GlobalState.capture", "mplaunch/", "capture"),
    ("remove stale launch dirs (listdir /dev/shm)", "mplaunch/", "_remove_stale_directories"),
    ("mkdtemp", "tempfile.py", "mkdtemp"),
    ("write payload file (not fork)", "mplaunch/", "dump"),
    ("TCPStore enter (_rendezvous)", "mplaunch/", "_rendezvous"),
    ("Process.start (all ranks)", "multiprocessing/process.py", "start"),
    ("set_forkserver_preload", "multiprocessing/context.py", "set_forkserver_preload"),
    ("waiting on workers (connection.wait)", "multiprocessing/connection.py", "wait"),
    ("collect outcome (join + load)", "mplaunch/", "_collect"),
    ("read outcome (_transport.load)", "mplaunch/", "load"),
    ("Supervisor.stop", "mplaunch/", "stop"),
    ("Process.close", "multiprocessing/process.py", "close"),
    ("rmtree launch dir", "shutil.py", "rmtree"),
)


#: The same for a worker, inside mplaunch's worker entry point.
WORKER_STEPS = (
    ("worker entry point (mplaunch._worker.run)", "mplaunch/", "run"),
    ("die-with-parent (ctypes prctl)", "mplaunch/", "_die_with_parent"),
    ("rank environment", "mplaunch/", "apply_environment"),
    ("set intra-op threads", "mplaunch/", "_set_threads"),
    ("read payload (_transport.load)", "mplaunch/", "load"),
    ("GlobalState.restore", "mplaunch/", "restore"),
    ("the function", "benchmarks/workers.py", "trivial"),
    ("write outcome", "mplaunch/", "_write_outcome"),
    ("atexit handlers", "~", "<built-in method atexit._run_exitfuncs>"),
)

_WORKER_PROFILES = "MPLAUNCH_BENCH_WORKER_PROFILES"


def profiled_run(*args: Any) -> None:
    """mplaunch's worker entry point under cProfile; the stats go to one file per process."""
    from mplaunch import _worker

    profiler = cProfile.Profile()
    try:
        profiler.runcall(_worker.run, *args)
    finally:
        profiler.dump_stats(os.path.join(os.environ[_WORKER_PROFILES], f"{os.getpid()}.prof"))


def raw_median(method: str, launches: int) -> float:
    from benchmarks.runners import BY_KEY

    raw = BY_KEY["raw"]
    raw_method = "forkserver+preload" if method == "forkserver" else method
    raw.launch(raw_method, workers.trivial, (), 120)
    samples = []
    for _ in range(launches):
        start = time.perf_counter()
        raw.launch(raw_method, workers.trivial, (), 120)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timeline(method: str, launches: int) -> dict[str, float]:
    """Median seconds from the call's start to each rank's first line, and from the last rank's first line
    to the call returning."""
    from mplaunch import parallel

    stamp = parallel(nprocs=2, start_method=method, return_all=True, timeout=120)(workers.stamp)
    stamp()
    rows = []
    for _ in range(launches):
        start = time.time()
        entered = stamp()
        end = time.time()
        rows.append((entered[0] - start, entered[1] - start, end - max(entered), end - start))
    names = (
        "start -> rank 0 in function",
        "start -> rank 1 in function",
        "last rank in function -> returned",
        "whole call",
    )
    return {name: statistics.median(row[i] for row in rows) for i, name in enumerate(names)}


def profile(method: str, launches: int) -> pstats.Stats:
    from mplaunch import parallel

    trivial = parallel(nprocs=2, start_method=method, timeout=120)(workers.trivial)
    trivial()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(launches):
        trivial()
    profiler.disable()
    return pstats.Stats(profiler)


def profile_workers(method: str, launches: int) -> tuple[pstats.Stats, int] | None:
    """cProfile of every worker over ``launches`` launches, and the number of worker processes profiled."""
    from mplaunch import _launcher, parallel

    if not hasattr(_launcher, "run"):
        return None
    trivial = parallel(nprocs=2, start_method=method, timeout=120)(workers.trivial)
    original = _launcher.run
    with tempfile.TemporaryDirectory(prefix="mplaunch-bench-profiles-") as directory:
        os.environ[_WORKER_PROFILES] = directory
        _launcher.run = profiled_run
        try:
            for _ in range(launches):
                trivial()
        finally:
            _launcher.run = original
            del os.environ[_WORKER_PROFILES]
        files = [os.path.join(directory, name) for name in os.listdir(directory)]
        return (pstats.Stats(*files), len(files)) if files else None


def step_times(stats: pstats.Stats, per: int, steps: tuple[tuple[str, str, str], ...]) -> list[tuple[str, float, int]]:
    """``(label, inclusive ms per launch or worker, calls per launch or worker)`` of every step that ran."""
    rows = []
    for label, filename, function in steps:
        total, calls = 0.0, 0
        for (file, _, name), (_, ncalls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
            if name == function and filename in file.replace("\\", "/"):
                total += cumulative
                calls += ncalls
        if calls:
            rows.append((label, total / per * 1e3, calls // per))
    return rows


def top_functions(stats: pstats.Stats, sort: str, count: int) -> str:
    buffer = io.StringIO()
    stats.stream = buffer  # type: ignore[attr-defined]
    stats.sort_stats(sort).print_stats(count)
    return buffer.getvalue()


def report(method: str, launches: int) -> str:
    lines = [f"== mplaunch {method}, warm, nprocs=2, trivial function"]
    for name, seconds in timeline(method, launches).items():
        lines.append(f"  {name:<44}{seconds * 1e3:8.1f} ms")
    lines.append(f"  {'raw torch.mp, same process (for scale)':<44}{raw_median(method, launches) * 1e3:8.1f} ms")
    stats = profile(method, launches)
    lines.append(f"  parent, cProfile of {launches} launches; inclusive ms per launch (steps overlap):")
    lines += [
        f"    {label:<50}{ms:8.2f} ms  ({calls} calls)" for label, ms, calls in step_times(stats, launches, STEPS)
    ]
    texts = [top_functions(stats, "cumulative", 60), top_functions(stats, "tottime", 40)]
    profiled = profile_workers(method, launches)
    if profiled is not None:
        worker_stats, count = profiled
        lines.append(f"  workers, cProfile of {count} worker processes; inclusive ms per worker:")
        rows = step_times(worker_stats, count, WORKER_STEPS)
        lines += [f"    {label:<50}{ms:8.2f} ms  ({calls} calls)" for label, ms, calls in rows]
        texts += ["\n== workers\n", top_functions(worker_stats, "cumulative", 40)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"profile-{method}.txt"
    path.write_text("".join(texts))
    lines.append(f"  heaviest functions: {path}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--methods", nargs="+", default=["fork", "forkserver"], choices=["fork", "forkserver", "spawn"])
    args = parser.parse_args(argv)
    for method in args.methods:
        print(report(method, args.launches), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
