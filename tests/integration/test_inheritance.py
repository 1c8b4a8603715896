"""What a worker inherits from the parent at call time, under each start method (README: "What a worker
inherits"): one launch per start method observes every row of the table."""

from __future__ import annotations

import logging
import multiprocessing.forkserver
import os
import random
import resource
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mplaunch import GlobalState, StartMethod, parallel
from tests import inherit_workers

TIMEOUT = 90
LOGGER = "mplaunch_inheritance"
FORMAT = "%(levelname)s|%(name)s|%(message)s"


@pytest.fixture
def parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A parent that changed everything the table lists after it started (and after the fork server did)."""
    if multiprocessing.forkserver._forkserver._forkserver_pid is None:  # type: ignore[attr-defined]
        parallel(nprocs=1, start_method="forkserver", timeout=TIMEOUT)(os.getpid)()  # the server predates the changes
    state = GlobalState.capture()
    umask = os.umask(0o027)
    core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (core[0] - 1 if core[0] > 0 else min(core[1] % 2**31, 4096) or 0, core[1]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on-sys-path"))
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--inheritance-mark"])
    monkeypatch.setenv("MPLAUNCH_INHERITANCE_MARK", "set in the parent")
    torch.set_float32_matmul_precision("medium")
    random.seed(7)
    torch.manual_seed(7)
    logger = logging.getLogger(LOGGER)
    handlers: list[logging.Handler] = [
        logging.FileHandler(tmp_path / "log.txt", mode="w", encoding="utf-8"),
        logging.StreamHandler(sys.stderr),
    ]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.info("logged by the parent")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="mplaunch-inheritance-ignored")
            yield {"rows": str(tmp_path / "rows.txt"), "log": tmp_path / "log.txt", "handlers": handlers}
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        os.umask(umask)
        resource.setrlimit(resource.RLIMIT_CORE, core)
        state.restore()


def _expected(handlers: list[logging.Handler]) -> dict[str, Any]:
    """What the parent itself sees now (its draws computed without disturbing its state)."""
    state = GlobalState.capture()
    try:
        draws = (random.random(), torch.rand(2).tolist())
    finally:
        state.restore()
    umask = os.umask(0)
    os.umask(umask)
    return {
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "env": os.environ["MPLAUNCH_INHERITANCE_MARK"],
        "warning_filters": list(warnings.filters),
        "ignored_warning_shown": 0,
        "logger": (logging.INFO, False, False),
        "handlers": [inherit_workers.handler_summary(h) for h in handlers],
        "matmul": "medium",
        "draws": draws,
        "umask": umask,
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE),
    }


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_workers_start_from_the_parent_as_it_is_at_call_time(parent: dict[str, Any], start_method: StartMethod) -> None:
    expected = _expected(parent["handlers"])
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)(inherit_workers.observe)
    results = run(parent["rows"], LOGGER)
    hashes = [seen.pop("hash") for seen in results]
    assert len(set(hashes)) == 1, "ranks hash strings differently"
    if start_method == "fork":
        assert hashes[0] == hash("abc")
    for seen in results:
        assert str(parent["rows"]).rsplit("/", 1)[0] + "/on-sys-path" in seen.pop("sys_path")
        assert seen == expected
    lines = parent["log"].read_text(encoding="utf-8").splitlines()
    assert lines[0] == f"INFO|{LOGGER}|logged by the parent"  # appended to, not truncated by the workers
    assert sorted(lines[1:]) == [f"INFO|{LOGGER}.child|logged by rank {rank}" for rank in range(2)]
    rows = Path(parent["rows"]).read_text().splitlines()
    assert sorted(rows) == ["row from rank 0", "row from rank 1"]  # written, never closed: flushed at exit


@pytest.mark.parametrize("case", ["plain", "flush-level", "no-process-ids", "last-handler-freed"])
def test_a_forked_worker_flushes_its_own_buffered_records_never_the_parents(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffering handler (MemoryHandler) that the parent made and a fork worker inherits holds the parent's
    records too: the worker writes only the records it logged (it wrote the parent's a second time), at
    exit or when a record reaches the handler's flush level, also without process ids in records and when
    the handler the parent made last is freed in the worker; a handler the worker made itself is flushed
    and closed as at a normal exit."""
    import logging.handlers

    from tests import workers

    name = f"{LOGGER}.buffered"
    target = logging.FileHandler(tmp_path / "inherited.log")
    target.setFormatter(logging.Formatter("%(message)s"))
    level = logging.WARNING if case == "flush-level" else logging.CRITICAL + 1
    buffered = logging.handlers.MemoryHandler(100, flushLevel=level, target=target)
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)  # the parent's record is buffered: below the flush level
    logger.addHandler(buffered)
    side = logging.getLogger(f"{name}.side")
    if case == "no-process-ids":
        monkeypatch.setattr(logging, "logProcesses", False)
    try:
        logger.info("the parent's record")
        if case == "last-handler-freed":
            side.addHandler(logging.NullHandler())  # the last handler made before the launch
        run = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.log_through_memory_handlers)
        run(name, str(tmp_path / "own.log"), side.name)
        inherited = (tmp_path / "inherited.log").read_text(encoding="utf-8").splitlines()
        assert sorted(inherited) == [f"rank {rank}, through the parent's handler" for rank in range(2)]
        for rank in range(2):
            own = (tmp_path / f"own.log.{rank}").read_text(encoding="utf-8")
            assert own == f"rank {rank}, through its own handler\n"
        buffered.flush()
        assert (tmp_path / "inherited.log").read_text(encoding="utf-8").count("the parent's record") == 1
    finally:
        logger.removeHandler(buffered)
        logger.setLevel(logging.NOTSET)
        buffered.close()
        target.close()
        side.handlers.clear()
        logging.getLogger(f"{name}.own").handlers.clear()


_SCRIPT = """
import logging
from mplaunch import parallel
from tests import inherit_workers


def main():
    logging.basicConfig(level=logging.INFO)  # inside main(), after the interpreter (and the fork server) started
    for start_method in ("spawn", "forkserver"):
        run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=90)
        print(start_method, run(inherit_workers.hash_and_log)("tests.inherit_workers"), flush=True)


if __name__ == "__main__":
    import multiprocessing.forkserver
    multiprocessing.forkserver.ensure_running()
    main()
"""


def test_the_issues_examples_in_a_fresh_interpreter_without_pythonhashseed() -> None:
    """hash("abc") agrees across spawn ranks with PYTHONHASHSEED unset; basicConfig(level=INFO) in main()
    reaches spawn and forkserver workers."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    for start_method in ("spawn", "forkserver"):
        line = next(line for line in done.stdout.splitlines() if line.startswith(start_method))
        hashes = eval(line.split(" ", 1)[1])  # noqa: S307 - a list of two ints printed by the script
        assert len(hashes) == 2, line
        assert hashes[0] == hashes[1], line
    for rank in range(2):
        assert done.stderr.count(f"INFO:tests.inherit_workers:info from rank {rank}") == 2, done.stderr


_STDIN_SCRIPT = """
import os, sys
from mplaunch import parallel

def read_stdin():
    target = os.readlink(f"/proc/self/fd/{sys.stdin.fileno()}")
    return sys.stdin.read(), target, sys.__stdin__.closed

if __name__ == "__main__":
    print(parallel(nprocs=2, start_method=sys.argv[1], return_all=True, timeout=90)(read_stdin)())
    print(repr(sys.stdin.read()))
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_rank_reads_nothing_from_a_piped_stdin_and_the_parent_reads_it_all(tmp_path: Path, start_method: str) -> None:
    """A standard input that is no terminal stays the caller's: a rank's ``sys.stdin`` is ``/dev/null`` and
    the stream it inherited is closed (as multiprocessing does), so the parent still reads every line."""
    script = tmp_path / "stdin_script.py"
    script.write_text(_STDIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script), start_method],
        input="the parent's line\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ranks, parent = done.stdout.splitlines()
    assert ranks == str([("", os.devnull, True)] * 2)
    assert parent == repr("the parent's line\n")


def test_a_rank_of_a_parent_without_sys_stdin_keeps_no_dev_null_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent opens one /dev/null reader for its forked ranks to take as ``sys.stdin``; where the parent
    has none (``sys.stdin`` is None: ``pythonw``, fd 0 closed), a rank keeps ``None`` and closes that reader."""
    from tests import workers

    monkeypatch.setattr(sys, "stdin", None)
    parents = set(workers.devnull_descriptors())  # (pytest's own, which a forked rank inherits)
    found = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, return_all=True)(workers.devnull_descriptors)()
    assert [set(each) - parents for each in found] == [set(), set()]
