"""Functions defined in a ``__main__`` that no worker can import: ``python -c`` and a script piped to
``python -`` (stdin). Under spawn and forkserver mplaunch sends them (and the classes and globals they use)
by value with cloudpickle; the default there is spawn, as these sessions are not interactive.

Each case runs one fresh interpreter that launches once per start method (spawn, forkserver, and the
default) and prints one JSON line per method (or the error), so one run reports all three methods. Spawned
workers import torch (seconds each on a small machine), so spawn launches use one worker and forkserver,
whose workers fork from one server, two.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: The program run as ``python -c PROGRAM`` or piped to ``python -``; its arguments are the start methods.
PROGRAM = """\
import dataclasses, json, sys, traceback
from mplaunch import parallel, worker_info

NPROCS = {"spawn": 1, "forkserver": 2, "default": 1}  # each spawned worker imports torch: seconds each

OFFSET = 100  # a global of __main__ the function reads


@dataclasses.dataclass
class Answer:  # a class of __main__ the workers return
    value: int
    rank: int


def compute(x):
    info = worker_info()
    cmdline = open("/proc/self/cmdline").read()
    how = "forkserver" if "forkserver" in cmdline else "spawn" if "spawn" in cmdline else "fork"
    return Answer(x * x + OFFSET + info.rank, info.rank), how


for method in sys.argv[1:]:
    start_method = None if method == "default" else method
    try:
        launch = parallel(nprocs=NPROCS[method], start_method=start_method, return_all=True, timeout=120)(compute)
        results = launch(3)
        line = {"method": method, "isinstance": [isinstance(a, Answer) for a, _ in results],
                "values": [dataclasses.astuple(a) for a, _ in results], "how": [how for _, how in results]}
    except BaseException as error:
        line = {"method": method, "error": "".join(traceback.format_exception(error))}
    print("RESULT", json.dumps(line), flush=True)
"""

METHODS = ("spawn", "forkserver", "default")


def _run(entry: str, tmp_path: Path) -> dict[str, Any]:
    if entry == "-c":
        command, stdin = [sys.executable, "-c", PROGRAM, *METHODS], None
    else:
        command, stdin = [sys.executable, "-", *METHODS], PROGRAM
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=tmp_path, timeout=240)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT ") :])
            results[item["method"]] = item
    report = f"exit code {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, report
    assert set(results) == set(METHODS), report
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["-c", "stdin"])
def test_function_from_main_without_file(entry: str, tmp_path: Path) -> None:
    results = _run(entry, tmp_path)
    failures = {m: r["error"] for m, r in results.items() if "error" in r}
    assert not failures, "\n".join(f"--- {m}:\n{tb}" for m, tb in failures.items())
    assert {**results["default"], "method": "spawn"} == results["spawn"], "outside a session the default is spawn"
    for method, nprocs in (("spawn", 1), ("forkserver", 2)):
        assert results[method]["values"] == [[109 + rank, rank] for rank in range(nprocs)], results[method]
        assert results[method]["isinstance"] == [True] * nprocs, results[method]
        assert results[method]["how"] == [method] * nprocs, results[method]
