"""One benchmark cell, in a fresh process: ``python -m benchmarks.cells NAME PLAN_JSON OUT_JSON [PART ...]``.

A cell (one launcher with one start method, ``mplaunch/fork``, or ``baselines``, ``arguments``, ``ddp``,
``output``, ``floor``, ``gpu``) is named parts, each measured by one function; with PARTs only those run (reruns of
noisy targets).
A fresh process makes a first launch a real first launch and keeps one launcher's leftovers from the next.
Results go to OUT_JSON after every part, so a cell killed at its time limit still reports what it measured."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import PeakRss, median, one_copy_seconds, timed
from benchmarks.floor import floor_parts
from benchmarks.gpu import gpu_parts
from benchmarks.launchers import BY_KEY, PAYLOADS, build_payload, gloo_cycle, make_payload, size, trivial
from benchmarks.warm import interactive_parts

TIMEOUT = 300.0  # seconds one launch may take
Parts = dict[str, Callable[[], Any]]


def touch(value: Any) -> None:
    """Read one byte per page of a tensor or array (single-threaded NumPy: GNU OpenMP hangs in forked
    children of a process that started its thread pool), as the first use of a lazily mapped result would."""
    import numpy

    if hasattr(value, "nbytes"):  # a tensor or an array
        flat = numpy.asarray(value).reshape(-1).view(numpy.uint8)
        numpy.add.reduce(flat[:: os.sysconf("SC_PAGE_SIZE")], dtype=numpy.int64)


def returned(launch: Callable[[], tuple[float, Any]], expected: int, count: int) -> list[dict[str, float]]:
    """Launches returning ``(time.time() when ready in rank 0, value)``: seconds from ready to the call
    returning here (``ret``), seconds to touch every page afterwards, and this process's peak RSS increase."""
    samples, rss = [], PeakRss()
    for _ in range(count):
        gc.collect()
        rss.reset()
        wall = time.time()
        [seconds], (ready, value) = timed(launch, timeout=TIMEOUT)
        touched = timed(lambda: touch(value))[0][0]  # noqa: B023
        if size(value) != expected:
            raise RuntimeError(f"the launcher returned {type(value).__name__} of size {size(value)}, not {expected}")
        samples.append({"ret": wall + seconds - ready, "touch": touched, "rss": rss.increase()})
        value = None
    return samples


def launcher_parts(name: str, plan: dict[str, Any]) -> Parts:
    """Import, first launch, warm trivial and gloo launches and, where the launcher returns values, results."""
    key, method = name.split("/")
    runner, slow = BY_KEY[key], "_slow" if method in BY_KEY[key].slow.split() else ""

    def launch(function: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return lambda: runner.launch(method, function, args, TIMEOUT)

    parts: Parts = {
        "import": lambda: importlib.import_module(runner.module) and None,
        "first": lambda: timed(launch(gloo_cycle if runner.own_group else trivial), timeout=TIMEOUT)[0][0],
    }
    if not runner.own_group:
        parts["launch"] = lambda: timed(launch(trivial), plan["warm" + slow], TIMEOUT)[0]
    if name == "mplaunch/fork":  # what watching adds (issue 22): stacks on timeout, heartbeats, the board
        parts["watched"] = lambda: timed(watched(), plan["warm"], TIMEOUT)[0]
    if plan["gloo" + slow]:
        parts["gloo"] = lambda: timed(launch(gloo_cycle), plan["gloo" + slow], TIMEOUT)[0]
    count = plan["payload_peers" if runner.peer else "payload"]
    for kind, expected in PAYLOADS.items() if runner.payloads == method else ():
        if not any(word in kind for word in runner.skip.split()):
            parts[kind] = functools.partial(returned, launch(make_payload, kind), expected, count)
    return parts


def watched() -> Callable[[], Any]:
    """A warm fork launch of :func:`trivial` with a ``timeout`` and a ``stall_timeout``: its ranks install the
    stack-dump handler and the parent makes and watches the heartbeat board."""
    from mplaunch import parallel

    run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, stall_timeout=TIMEOUT)(trivial)
    run()
    return run  # type: ignore[no-any-return]


def baseline(kind: str, count: int) -> list[float]:
    """One copy into new shared memory (tensors, arrays), or a pickle round trip (the others)."""
    value = build_payload(kind)
    if kind.endswith(("tensor", "array")):
        return one_copy_seconds(value, count)
    return timed(lambda: pickle.loads(pickle.dumps(value, protocol=5)), count)[0]


def imports(count: int) -> dict[str, list[float]]:
    """``import torch`` then ``import mplaunch`` in fresh interpreters, mplaunch compiled first as a wheel is."""
    import compileall

    compileall.compile_dir(str(Path(__file__).parent.parent / "mplaunch"), quiet=1)
    probe = "from benchmarks.common import timed; import json; "
    probe += "print(json.dumps([timed(lambda: __import__(m))[0][0] for m in ('torch', 'mplaunch')]))"
    command = [sys.executable, "-c", probe]
    runs = [json.loads(subprocess.run(command, capture_output=True, check=True).stdout) for _ in range(count)]
    return {"torch": [r[0] for r in runs], "mplaunch": [r[1] for r in runs]}


def baselines_parts(plan: dict[str, Any]) -> Parts:
    from mplaunch import GlobalState

    parts: Parts = {kind: functools.partial(baseline, kind, plan["payload"]) for kind in PAYLOADS}
    parts["state"] = lambda: median(timed(lambda: GlobalState.capture().restore(), plan["state"])[0])
    parts["imports"] = functools.partial(imports, plan["repeats"])
    return parts


def spawn_argument(large: Any, count: int) -> dict[str, list[float]]:
    """Spawn launches with a 1-byte array, then with ``large``: extra seconds and the parent's peak RSS."""
    from mplaunch import parallel

    samples: dict[str, list[float]] = {"small": [], "extra": [], "rss": []}
    rss, noop = PeakRss(), parallel(nprocs=2, start_method="spawn", timeout=TIMEOUT)(trivial)
    small = large[:1].copy()
    for _ in range(count):
        samples["small"] += timed(lambda: noop(small), timeout=TIMEOUT)[0]
        rss.reset()
        samples["extra"].append(timed(lambda: noop(large), timeout=TIMEOUT)[0][0] - samples["small"][-1])
        samples["rss"].append(rss.increase())
    return samples


def fork_argument(value: Any, count: int) -> dict[str, list[float]]:
    """Warm fork launches with ``value`` as the argument, mplaunch and raw interleaved, after one of each."""
    samples: dict[str, list[float]] = {"mplaunch": [], "raw": []}
    for index in range(count + 1):
        for key in samples:
            seconds = timed(lambda: BY_KEY[key].launch("fork", trivial, (value,), TIMEOUT))[0]  # noqa: B023
            samples[key] += seconds if index else []
    return samples


def ddp_wall(count: int) -> dict[str, list[float]]:
    """The whole command, ``ddp_script.py`` under ``@parallel`` (spawn) and under torchrun, alternately."""
    script = str(Path(__file__).with_name("ddp_script.py"))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    commands = {"mplaunch": [sys.executable, script, "--mplaunch"], "torchrun": [*run, script]}
    samples: dict[str, list[float]] = {key: [] for key in commands}
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:  # torchrun leaves a log directory there
        for _ in range(count):
            for key, command in commands.items():
                run = functools.partial(subprocess.run, command, check=True, env={**os.environ, "TMPDIR": tmp})
                samples[key] += timed(run, timeout=TIMEOUT)[0]
    return samples


def write_text(nbytes: int = 100 * 10**6, line_bytes: int = 100) -> float:
    """In the worker: print ``nbytes`` of text, one ``print`` per line; return the seconds it took."""
    line = "x" * (line_bytes - 1)

    def write() -> None:
        for _ in range(nbytes // line_bytes):
            print(line)
        sys.stdout.flush()

    return timed(write, timeout=TIMEOUT)[0][0]


def output(prefix: bool, count: int) -> dict[str, list[float]]:
    """One rank writing 100 MB with ``prefix_output=prefix``; this process's fd 1 points at /dev/null meanwhile,
    so that what is measured is the routing, not the console."""
    from mplaunch import parallel

    write = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT, prefix_output=prefix)(write_text)
    samples: dict[str, list[float]] = {"write": [], "launch": []}
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    os.dup2(null, 1)
    try:
        for _ in range(count):
            samples["launch"] += timed(lambda: samples["write"].append(write()), timeout=TIMEOUT)[0]
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return samples


def main(name: str, plan_json: str, out: str, *wanted: str) -> None:
    import psutil

    plan = json.loads(plan_json)
    parts = {
        "baselines": baselines_parts,
        "arguments": lambda p: {
            "4 MiB bytes": functools.partial(fork_argument, b"x" * (4 << 20), p["warm"]),
            "list 10**6 ints": functools.partial(fork_argument, list(range(10**6)), p["warm"]),
            "400 MB NumPy array": functools.partial(spawn_argument, build_payload("400 MB NumPy array"), p["repeats"]),
        },
        "ddp": lambda p: {"wall": functools.partial(ddp_wall, p["repeats"])},
        "output": lambda p: {k: functools.partial(output, k == "on", p["repeats"]) for k in ("off", "on")},
        "floor": floor_parts,
        "interactive": interactive_parts,
        "gpu": gpu_parts,
    }.get(name, functools.partial(launcher_parts, name))(plan)
    result: dict[str, Any] = {"errors": {}}
    for part, measure in parts.items():
        if wanted and part not in (*wanted, "import", "first"):
            continue
        print(f"{time.strftime('%H:%M:%S')} {part}", flush=True)
        try:
            result[part] = measure()
        except Exception as error:  # noqa: BLE001 - a peer failing at runtime is reported, not fatal
            traceback.print_exc()
            result["errors"][part] = f"{type(error).__name__}: {error}".strip()[:300]
            for child in psutil.Process().children(recursive=True):  # what the failed launch left behind
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with open(out, "w") as file:
            json.dump(result, file)
        if "import" in result["errors"]:
            break


if __name__ == "__main__":
    main(*sys.argv[1:])
