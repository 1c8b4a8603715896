"""mplaunch in a real Jupyter kernel, run headless with nbclient.

Each test builds a notebook with nbformat in its ``tmp_path``, runs it in a fresh IPython kernel (ipykernel)
and checks the executed notebook's outputs; cells also ``assert`` inside the kernel, and a failed assert is a
cell error, which nbclient raises as ``CellExecutionError`` with the kernel's traceback.

The kernel is always the interpreter running pytest, in ``tmp_path`` (see tests/notebooks/kernels.py).

Each test has a ``pytest.mark.timeout`` and each cell a timeout (``CELL_TIMEOUT``), so a hung launch fails
in seconds, with the cell named. These tests start kernels and torch-importing workers; they are ``slow``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import nbformat  # noqa: E402
from nbformat import NotebookNode  # noqa: E402

from tests.notebooks.kernels import (  # noqa: E402
    IMPORTS,
    _alive,
    _asleep,
    _assert_no_launch_directories,
    _client,
    _errors,
    _kernel,
    _kernel_env,
    _notebook,
    _outputs,
    _result_line,
    _run,
    _text,
    _workers_of,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc and process groups: Linux"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"


@pytest.mark.timeout(150)
def test_fork_default_all_reduce_with_cell_defined_function(tmp_path: Path) -> None:
    """A function defined in a cell runs on 2 forked workers (the default in a kernel) that all_reduce."""
    nb = _notebook(
        IMPORTS,
        """\
import torch.distributed as dist

@parallel(nprocs=2)
def all_reduce(x):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(x + rank)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    # a forked worker runs the kernel's own program; a spawned one runs multiprocessing's spawn_main
    cmdline = open("/proc/self/cmdline").read().replace("\\0", " ")
    return {"rank": rank, "sum": total.item(), "forked": "ipykernel_launcher" in cmdline, "pid": os.getpid()}

result = all_reduce(10)
print("RESULT", json.dumps(result))
""",
    )
    _run(nb, tmp_path)
    result = _result_line(nb.cells[1], "RESULT")
    assert result["sum"] == 21.0  # (10 + 0) + (10 + 1)
    assert result["rank"] == 0
    assert result["forked"], "the default start method in a kernel should be fork"


@pytest.mark.timeout(150)
def test_fork_after_multithreaded_matmul_does_not_hang(tmp_path: Path) -> None:
    """GNU OpenMP's pool does not survive fork: once the kernel ran a multi-threaded matmul, a forked worker
    that runs parallel torch code would hang. mplaunch releases the pool before forking (``mplaunch._parent.policy``),
    so the worker keeps every core's thread (cores // nprocs) and finishes; train -> evaluate in the kernel ->
    train again (issue 10) works too. ``timeout=`` turns a hang into a ``LaunchTimeoutError`` in the cell well
    before the cell timeout. forkserver gives a worker every core's thread as well.
    """
    nb = _notebook(
        IMPORTS,
        """\
torch.set_num_threads(2)
a = torch.randn(2000, 2000)
b = a @ a  # starts OpenMP's thread pool in the kernel
""",
        """\
@parallel(nprocs=1, timeout=30)
def big_matmul():
    x = torch.randn(2000, 2000)
    y = x @ x
    return {"threads": torch.get_num_threads(), "norm_finite": bool(torch.isfinite(y.norm()))}

result = big_matmul()
b = a @ a  # the kernel's pool is live again
result_again = big_matmul()
print("RESULT", json.dumps([result, result_again]))
""",
        """\
# the warning's advice: forkserver workers start from a clean server process and may use every thread
@parallel(nprocs=1, start_method="forkserver", timeout=60)
def big_matmul_forkserver():
    x = torch.randn(2000, 2000)
    y = x @ x
    return {"threads": torch.get_num_threads(), "norm_finite": bool(torch.isfinite(y.norm()))}

print("RESULT", json.dumps(big_matmul_forkserver()))
""",
    )
    _run(nb, tmp_path, OMP_NUM_THREADS=None)
    cores = len(os.sched_getaffinity(0))
    assert _result_line(nb.cells[2], "RESULT") == [{"threads": cores, "norm_finite": True}] * 2
    assert "OpenMP" not in _text(nb.cells[2], "stderr"), _outputs(nb.cells[2])
    assert _result_line(nb.cells[3], "RESULT") == {"threads": cores, "norm_finite": True}


@pytest.mark.timeout(150)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for a worker to want 2 threads")
def test_fork_in_fresh_kernel_keeps_worker_threads(tmp_path: Path) -> None:
    """Before any multi-threaded torch op, a forked worker may use cores // nprocs threads, and mplaunch
    should not warn about an OpenMP pool that was never started. (A kernel has native threads of its own,
    ZeroMQ's I/O and reaper threads, which are no OpenMP pool.)"""
    nb = _notebook(
        IMPORTS,
        """\
import warnings
cores = len(os.sched_getaffinity(0))

@parallel(nprocs=1)
def threads():
    return torch.get_num_threads()

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    n = threads()
print("RESULT", json.dumps({"threads": n, "cores": cores, "warnings": [str(w.message) for w in caught]}))
""",
    )
    _run(nb, tmp_path, OMP_NUM_THREADS=None)
    result = _result_line(nb.cells[1], "RESULT")
    assert result["warnings"] == [], "mplaunch warned about an OpenMP pool in a kernel that never started one"
    assert result["threads"] == result["cores"], result


@pytest.mark.timeout(150)
def test_spawn_cell_defined_function_and_result_class(tmp_path: Path) -> None:
    """Under spawn, a function and a dataclass defined in cells travel by value (cloudpickle); the workers'
    results come back as instances of the kernel's own class, and their prints reach the cell."""
    nb = _notebook(
        IMPORTS,
        """\
import dataclasses

@dataclasses.dataclass
class Summary:
    rank: int
    total: float

SCALE = 3.0  # a cell global the function reads

@parallel(nprocs=2, start_method="spawn", return_all=True)
def summarize(n):
    rank = worker_info().rank
    print(f"spawned worker rank {rank} of {worker_info().world_size}", flush=True)
    return Summary(rank, SCALE * float(torch.arange(n).sum()))

results = summarize(5)
assert all(isinstance(r, Summary) for r in results), [type(r) for r in results]
print("RESULT", json.dumps({"isinstance": [isinstance(r, Summary) for r in results],
                            "values": [dataclasses.asdict(r) for r in results]}))
""",
    )
    _run(nb, tmp_path)
    cell = nb.cells[1]
    result = _result_line(cell, "RESULT")
    assert result["isinstance"] == [True, True]
    assert result["values"] == [{"rank": 0, "total": 30.0}, {"rank": 1, "total": 30.0}]
    out = _text(cell)
    for rank in range(2):
        assert f"spawned worker rank {rank} of 2" in out, _outputs(cell)


@pytest.mark.timeout(150)
def test_forked_worker_prints_reach_the_cell(tmp_path: Path) -> None:
    """What forked workers print shows in the cell's output, before the cell ends, for every rank (the kernel's
    ``sys.stdout`` is no descriptor, so the workers' fd 1 and 2 go through the parent, see ``_pump``)."""
    nb = _notebook(
        IMPORTS,
        """\
@parallel(nprocs=2)
def hello(word):
    info = worker_info()
    print(f"{word} from rank {info.rank} of {info.world_size}")
    print(f"stderr line from rank {info.rank}", file=sys.stderr)
    return "done"

print("RESULT", json.dumps(hello("hello")))
""",
        "print('next cell')",
    )
    _run(nb, tmp_path)
    cell = nb.cells[1]
    assert _result_line(cell, "RESULT") == "done"
    out, err = _text(cell), _text(cell, "stderr")
    for rank in range(2):
        assert f"hello from rank {rank} of 2" in out, _outputs(cell)
        assert f"stderr line from rank {rank}" in err, _outputs(cell)
    assert "rank" not in _text(nb.cells[2]), "worker output leaked into the next cell"


CHATTY_CELL = """\
import logging, signal, subprocess, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", force=True)

def chatty(lines, die=False):
    rank = worker_info().rank
    for i in range(lines):
        print(f"line {i} of rank {rank} " + "x" * 60)
    logging.warning("log of rank %d", rank)  # fork: the kernel's handler; spawn: logging's last resort
    os.write(1, f"os.write of rank {rank}\\n".encode())
    subprocess.run(["echo", f"echo of rank {rank}"], check=True)
    sys.stdout.write(f"\\rprogress of rank {rank}")
    sys.stdout.flush()
    if die and rank == 0:
        open("rank0-spoke", "w").close()
    if die and rank == 1:  # once rank 0 has said all (the launch then stops it)
        deadline = time.monotonic() + 30
        while not os.path.exists("rank0-spoke") and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdout.write("\\n")
    return rank
"""


def _check_rank_lines(cell: NotebookNode, ranks: list[int], prefix: bool, lines: int = 200) -> None:
    """Every line of ``ranks`` is in the cell, whole and once; no line of another rank is."""
    out, err = _text(cell).split("\n"), _text(cell, "stderr").split("\n")
    for rank in range(2):
        label = f"[rank {rank}] " if prefix else ""
        wanted = [f"line {i} of rank {rank} " + "x" * 60 for i in range(lines)]
        wanted += [f"os.write of rank {rank}", f"echo of rank {rank}", f"\r{label}progress of rank {rank}"]
        for line in wanted:
            expected = line if line.startswith("\r") else label + line
            assert out.count(expected) == (rank in ranks), (expected, _outputs(cell))
        logged = [line for line in err if f"log of rank {rank}" in line]
        assert len(logged) == (rank in ranks), _outputs(cell)
        assert all(line.startswith(label) for line in logged), _outputs(cell)


@pytest.mark.timeout(200)
def test_cell_shows_each_ranks_lines_whole_and_once(tmp_path: Path) -> None:
    """Under fork and spawn, with and without the output options: print, a logging handler made in the kernel
    before the launch, C-level writes, a subprocess and a progress bar all reach the cell, each line whole and
    once; ``console_ranks`` filters, ``log_dir`` gets every rank; a killed rank's last output is kept."""
    nb = _notebook(
        IMPORTS,
        CHATTY_CELL,
        'print("RESULT", json.dumps(parallel(nprocs=2, start_method="fork", timeout=60)(chatty)(200)))',
        """\
run = parallel(nprocs=2, start_method="spawn", timeout=60, prefix_output=True, console_ranks=[0], log_dir="logs")
print("RESULT", json.dumps(run(chatty)(200)))
""",
        """\
try:
    parallel(nprocs=2, start_method="fork", timeout=60, prefix_output=True, grace_period=1)(chatty)(200, die=True)
except mplaunch.WorkerExitedError as error:
    print("RAISED", error.rank)
""",
    )
    _run(nb, tmp_path)
    assert _result_line(nb.cells[2], "RESULT") == 0
    _check_rank_lines(nb.cells[2], [0, 1], prefix=False)
    assert _result_line(nb.cells[3], "RESULT") == 0
    _check_rank_lines(nb.cells[3], [0], prefix=True)
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "[rank 1] line 199 of rank 1" in log, log
    assert "[rank 1] echo of rank 1" in log, log
    out = _text(nb.cells[4])
    assert out.index("\r[rank 1] progress of rank 1") < out.index("RAISED 1"), _outputs(nb.cells[4])
    _check_rank_lines(nb.cells[4], [0, 1], prefix=True)


@pytest.mark.timeout(180)
def test_interrupt_stops_workers_and_relaunch_works(tmp_path: Path) -> None:
    """Interrupting the kernel (Jupyter's "interrupt" button: SIGINT to the kernel's process group) while
    workers run ends the cell with KeyboardInterrupt within seconds, leaves no worker behind, and the next
    cell launches again."""
    nb = _notebook(
        IMPORTS,
        """\
import time

@parallel(nprocs=2)
def sleepy(seconds):
    with open(f"worker-{worker_info().rank}.pid", "w") as file:
        file.write(str(os.getpid()))
    time.sleep(seconds)
    return "slept"

sleepy(60)
""",
        """\
@parallel(nprocs=2)
def again(x):
    return x + worker_info().rank

print("RESULT", json.dumps(again(41)))
""",
        tags={1: ["raises-exception"]},
    )
    client = _client(nb, tmp_path)

    async def scenario() -> dict[str, Any]:
        facts: dict[str, Any] = {}
        async with client.async_setup_kernel(env=_kernel_env(tmp_path)):
            manager, kernel_pid = _kernel(client)
            facts["kernel_pid"] = kernel_pid
            await client.async_execute_cell(nb.cells[0], 0, execution_count=1)
            launch = asyncio.ensure_future(client.async_execute_cell(nb.cells[1], 1, execution_count=2))
            deadline = time.monotonic() + 60
            pid_files = [tmp_path / f"worker-{rank}.pid" for rank in range(2)]
            while not all(p.exists() and p.read_text() for p in pid_files):
                assert not launch.done(), _outputs(nb.cells[1])
                assert time.monotonic() < deadline, "the workers did not start within 60 s"
                await asyncio.sleep(0.1)
            facts["workers"] = [int(p.read_text()) for p in pid_files]
            while not all(_asleep(pid) for pid in facts["workers"]):  # in time.sleep(60), past the pid file
                assert time.monotonic() < deadline, "the workers did not reach time.sleep within 60 s"
                await asyncio.sleep(0.05)
            facts["children_before"] = [c.pid for c in _workers_of(kernel_pid)]
            interrupted = time.monotonic()
            await manager.interrupt_kernel()
            await asyncio.wait_for(launch, timeout=30)
            facts["stop_seconds"] = time.monotonic() - interrupted
            facts["children_after"] = [(c.pid, c.name(), c.status()) for c in _workers_of(kernel_pid)]
            facts["alive_after"] = [pid for pid in facts["workers"] if _alive(pid)]
            await client.async_execute_cell(nb.cells[2], 2, execution_count=3)
            facts["children_end"] = [(c.pid, c.name()) for c in _workers_of(kernel_pid)]
        return facts

    facts = asyncio.run(scenario())
    nbformat.write(nb, tmp_path / "executed.ipynb")
    assert set(facts["workers"]) <= set(facts["children_before"]), facts
    errors = _errors(nb.cells[1])
    assert [e.ename for e in errors] == ["KeyboardInterrupt"], _outputs(nb.cells[1])
    assert facts["stop_seconds"] < 10, facts
    assert facts["children_after"] == [], f"workers left after the interrupt: {facts}"
    assert facts["alive_after"] == [], facts
    assert _result_line(nb.cells[2], "RESULT") == 41
    assert facts["children_end"] == [], facts
    _assert_no_launch_directories(facts["kernel_pid"])


@pytest.mark.timeout(240)
def test_example_notebook_runs_top_to_bottom(tmp_path: Path) -> None:
    """examples/notebook.ipynb runs headless without an error, as a user would run it."""
    nb = nbformat.read(EXAMPLE, as_version=4)
    _run(nb, tmp_path, own=False)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not _errors(cell), f"cell {index} failed:\n{_outputs(cell)}"
    text = "".join(_text(cell) + _outputs(cell) for cell in nb.cells if cell.cell_type == "code")
    assert "hello from rank 0 of 2" in text, text
    assert "hello from rank 1 of 2" in text, text
    assert "[3.0, 3.0]" in text, text  # the all_reduce, on both ranks
    assert "True" in _text(_cell_with(nb, "isinstance(result, Stats)")), text
    assert "caught ValueError from rank 1" in text, text


def _cell_with(nb: NotebookNode, snippet: str) -> NotebookNode:
    cell: NotebookNode = next(cell for cell in nb.cells if cell.cell_type == "code" and snippet in cell.source)
    return cell
