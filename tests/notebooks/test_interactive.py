"""Functions defined in a ``__main__`` that no worker can import: ``python -c`` and a script piped to
``python -`` (stdin). Under spawn and forkserver mplaunch sends them (and the classes and globals they use)
by value with cloudpickle; the default there is spawn, as these sessions are not interactive.

Each case runs one fresh interpreter that launches once per start method and prints one JSON line per
method (or the error), so one run reports all three methods.
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

OFFSET = 100  # a global of __main__ the function reads


@dataclasses.dataclass
class Answer:  # a class of __main__ the workers return
    value: int
    rank: int


def compute(x):
    info = worker_info()
    return Answer(x * x + OFFSET + info.rank, info.rank)


for method in sys.argv[1:]:
    start_method = None if method == "default" else method
    try:
        launch = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=120)(compute)
        answers = launch(3)
        line = {"method": method, "isinstance": [isinstance(a, Answer) for a in answers],
                "values": [dataclasses.astuple(a) for a in answers]}
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
    assert done.returncode == 0 and set(results) == set(METHODS), (
        f"exit code {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["-c", "stdin"])
def test_function_from_main_without_file(entry: str, tmp_path: Path) -> None:
    results = _run(entry, tmp_path)
    failures = {m: r["error"] for m, r in results.items() if "error" in r}
    assert not failures, "\n".join(f"--- {m}:\n{tb}" for m, tb in failures.items())
    for method in METHODS:
        assert results[method]["values"] == [[109, 0], [110, 1]], results[method]
        assert results[method]["isinstance"] == [True, True], results[method]
