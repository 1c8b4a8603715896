"""Benchmark mplaunch against raw ``torch.multiprocessing`` and other launchers, in one run.

Usage::

    python benchmarks/run.py [--quick] [--only [RUNNER ...]] [--results DIR]

(``benchmarks/profile_launch.py`` profiles a warm launch; see its docstring.)

What is measured, always with ``nprocs=2`` on this machine:

(a) Launch latency of a function that does nothing: the first call in a fresh process (fork server not
    started yet) and the median of later calls, per start method (fork, forkserver, spawn).
(b) Result return from rank 0 of an int, a list of 10**6 ints, and 1 MiB / 64 MiB / 512 MiB float32 tensors:
    rank 0 builds the value, notes ``time.time()`` and returns both; the parent notes ``time.time()`` when
    the call returns, so the interval covers pickling, transport, the workers' exit and unpickling (and
    waiting for rank 1, which returns None: a call returns when every rank has finished). The
    parent's peak RSS increase is read from the kernel (``VmHWM`` after resetting it through
    ``/proc/self/clear_refs``, see ``measure.PeakRss``) after reading every page of the result, so a
    lazily mapped result is counted once it is used. Baselines, in-process: one copy of the tensor into a
    new shared-memory storage, and a pickle round trip of the list.
(c) A launch whose function sets up a gloo process group from the environment, all-reduces one number and
    tears the group down.
Also: ``import mplaunch`` on top of ``import torch`` (fresh interpreters, median), and
``GlobalState.capture().restore()`` when nothing differs.

How: every (launcher, start method) pair is a *cell* run in a fresh process (``cell.py``) with a deadline
on every launch and a time limit on the cell; processes a cell leaves behind are reported and killed. All
cells run once per *round*; a ratio to the raw ``torch.multiprocessing.start_processes`` baseline compares
cells of the same round. Peers (Lightning Fabric, Accelerate, Ignite) come from the ``bench`` extra and are
skipped with a note when missing or failing; ``elastic_launch`` ships with torch. The table is printed and
written with every sample to ``benchmarks/results/latest.json``; the chart goes to
``benchmarks/results/chart.png`` and is copied to ``benchmarks/chart.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.config import FULL, METHOD_ORDER, QUICK, Plan  # noqa: E402
from benchmarks.runners import RUNNERS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
IMPORT_PROBE = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import mplaunch; "
    "t2 = time.perf_counter(); print(t1 - t0, t2 - t1, mplaunch.__file__)"
)
PACKAGES = ("torch", "mplaunch", "lightning", "accelerate", "pytorch-ignite", "matplotlib", "psutil")


def child_environment() -> dict[str, str]:
    """The environment of cells: this checkout importable as ``benchmarks`` (after any user ``PYTHONPATH``,
    so another mplaunch can be benchmarked by putting it first)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def leftover_processes(group: int, wait: float = 3.0) -> int:
    """Kill, by pid, the live processes still in process group ``group`` after ``wait`` seconds (fork servers
    and resource trackers exit on their own shortly after their parent); return how many there were."""
    import psutil

    def members() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["status"]):
            try:
                if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (OSError, psutil.Error):
                continue
        return found

    deadline = time.monotonic() + wait
    while (left := members()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    return len(left)


def run_cell(runner: str, method: str, plan: Plan, label: str, logs: Path) -> dict[str, Any]:
    """Run one cell in a fresh process (its own session, so all its processes can be found) and return what
    it measured, with its errors."""
    out = logs / f"{label}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.cell", runner, method, plan.to_json(), str(out)]
    killed = False
    with open(logs / f"{label}.log", "w") as log:
        process = subprocess.Popen(
            command, cwd=logs, env=child_environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=plan.cell_timeout)
        except subprocess.TimeoutExpired:
            killed = True
            process.kill()
            process.wait()
    left = leftover_processes(process.pid)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    errors = result.setdefault("errors", {})
    if killed:
        errors["cell"] = f"ran past its limit of {plan.cell_timeout:g} s and was killed; see {logs / label}.log"
    elif process.returncode:
        errors["cell"] = f"exited with code {process.returncode}; see {logs / label}.log"
    if left:
        errors["leftovers"] = f"{left} process(es) still alive after the cell; killed"
    return result


def cells_of_round(plan: Plan, only: set[str] | None, notes: list[str]) -> list[tuple[str, str]]:
    """``(runner, method)`` pairs in table order (methods outer), skipping peers that are not installed and,
    unless the plan says otherwise, peers' slow methods."""
    available = []
    for runner in RUNNERS:
        if runner.peer and only is not None and runner.key not in only:
            continue
        reason = runner.missing()
        if reason:
            notes.append(f"skipped {runner.label}: {reason}")
        else:
            available.append(runner)
    if not plan.peers_slow:
        notes.append("peers' spawn cells are measured only without --quick")
    return [
        (r.key, m)
        for m in METHOD_ORDER
        for r in available
        if m in r.methods and (plan.peers_slow or not r.peer or m not in r.slow_methods)
    ]


def run_round(index: int, plan: Plan, cells: list[tuple[str, str]], logs: Path, started: float) -> dict[str, Any]:
    data: dict[str, Any] = {"cells": {}}
    for runner, method in [("baselines", "-"), *cells]:
        cell_started = time.perf_counter()
        result = run_cell(runner, method, plan, f"r{index}-{runner}-{method}", logs)
        if runner == "baselines":
            data["baselines"] = result
        else:
            data["cells"][f"{runner}/{method}"] = result
        status = "; ".join(f"{k}: {v}" for k, v in result.get("errors", {}).items()) or "ok"
        print(
            f"[{time.perf_counter() - started:6.1f} s] round {index + 1}/{plan.rounds} {runner}/{method}: "
            f"{time.perf_counter() - cell_started:.1f} s, {status}",
            file=sys.stderr,
            flush=True,
        )
    return data


def cell_errors(rounds: list[dict[str, Any]]) -> list[str]:
    """One note per distinct failure: ``runner/method part: error (rounds ...)``."""
    seen: dict[str, list[int]] = {}
    for index, data in enumerate(rounds):
        for name, cell in {"baselines": data.get("baselines", {}), **data["cells"]}.items():
            for part, error in cell.get("errors", {}).items():
                seen.setdefault(f"{name} {part}: {error}", []).append(index + 1)
    return [f"{text} (round {', '.join(map(str, indices))})" for text, indices in seen.items()]


def measure_imports(plan: Plan, logs: Path) -> dict[str, Any]:
    """Median seconds of ``import torch`` and of ``import mplaunch`` after it, in fresh interpreters.

    mplaunch's bytecode is compiled first, as installing a wheel does: with PYTHONDONTWRITEBYTECODE set (as on
    these machines) an editable checkout would otherwise be compiled from source at every import, while
    torch's installed bytecode is not.
    """
    import compileall

    compileall.compile_dir(str(ROOT / "mplaunch"), quiet=1)
    torch_s, mplaunch_s, path = [], [], ""
    for _ in range(plan.imports):
        output = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE],
            cwd=logs,
            env=child_environment(),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()
        torch_s.append(float(output[0]))
        mplaunch_s.append(float(output[1]))
        path = output[2]
    return {
        "mplaunch_file": path,
        "torch": statistics.median(torch_s),
        "mplaunch_after_torch": statistics.median(mplaunch_s),
        "n": plan.imports,
        "samples_torch": torch_s,
        "samples_mplaunch": mplaunch_s,
    }


def describe_environment() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "load_average_at_start": os.getloadavg(),
        "versions": versions,
        "git": commit.stdout.strip() or None,
    }


def save(results: dict[str, Any], directory: Path, publish: bool) -> str | None:
    """Write ``latest.json`` and ``chart.png`` to ``directory``; with ``publish``, copy the chart to
    ``benchmarks/chart.png``. Return a note when no chart could be drawn."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "latest.json").write_text(json.dumps(results, indent=1))
    env = results["environment"]
    title = (
        f"mplaunch benchmarks ({results['plan']['name']}, {env['usable_cpus']} CPUs, torch "
        f"{env['versions']['torch']}, mplaunch {env['git']})"
    )
    try:
        report.draw_chart(results["summary"], str(directory / "chart.png"), title)
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -e '.[bench]')"
    if publish:
        shutil.copyfile(directory / "chart.png", ROOT / "benchmarks" / "chart.png")
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and one round (< 3 minutes on 2 cores)")
    parser.add_argument(
        "--only",
        nargs="*",
        metavar="RUNNER",
        choices=[r.key for r in RUNNERS],
        help="measure only these peers, none if no name is given (raw torch and mplaunch are always measured)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        help=f"write results here instead of {RESULTS.relative_to(ROOT)} (and leave benchmarks/chart.png alone)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    directory = (args.results or RESULTS).resolve()
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    cells = cells_of_round(plan, None if args.only is None else set(args.only), notes)
    environment = describe_environment()
    if environment["load_average_at_start"][0] > 0.5:
        notes.append(
            f"the machine was busy at the start (load average {environment['load_average_at_start'][0]:.1f}"
            "); timings may be noisy"
        )
    imports = measure_imports(plan, logs)
    rounds = [run_round(index, plan, cells, logs, started) for index in range(plan.rounds)]
    environment["load_average_at_end"] = os.getloadavg()
    notes += cell_errors(rounds)
    summary = report.summarize(rounds, imports)
    notes.append(f"total {time.perf_counter() - started:.0f} s; samples and logs in {directory}")
    results = {
        "plan": json.loads(plan.to_json()),
        "environment": environment,
        "imports": imports,
        "rounds": rounds,
        "summary": summary,
        "notes": notes,
    }
    chart_note = save(results, directory, publish=args.results is None)
    if chart_note:
        notes.append(chart_note)
    print(report.format_report(summary, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
