"""Warm workers in a real Jupyter kernel (issue 24): state kept across cells, functions of re-run cells
reach the ranks, interrupting the kernel stops the call but not the ranks, and shutting the kernel down
leaves nothing behind."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.notebooks.kernels import (
    IMPORTS,
    _alive,
    _assert_no_launch_directories,
    _client,
    _errors,
    _kernel,
    _kernel_env,
    _notebook,
    _outputs,
    _result_line,
    _run,
)

pytestmark = pytest.mark.slow

START = """\
from mplaunch import Workers

counter = 0

def bump():
    global counter
    counter += 1
    return os.getpid(), counter

workers = Workers(nprocs=2, start_method="fork", return_all=True, timeout=120)
print("RESULT", json.dumps(workers.run(bump)))
"""

LATER = """\
def read():  # defined after the ranks started; reads the global the ranks own
    print("printed by rank", worker_info().rank, flush=True)
    return counter * 10

print("RESULT", json.dumps(workers.run(read)))
"""

SLEEPY = """\
import time

def sleepy():
    open(f"started-{worker_info().rank}", "w").close()
    time.sleep(300)

workers.run(sleepy)
"""


@pytest.mark.timeout(240)
def test_warm_workers_across_cells_interrupt_and_shutdown(tmp_path: Path) -> None:
    nb = _notebook(
        IMPORTS, START, LATER, SLEEPY, 'print("RESULT", json.dumps(workers.run(bump)))', tags={3: ["raises-exception"]}
    )
    client = _client(nb, tmp_path)

    async def scenario() -> dict[str, Any]:
        facts: dict[str, Any] = {}
        async with client.async_setup_kernel(env=_kernel_env(tmp_path)):
            manager, facts["kernel_pid"] = _kernel(client)
            for index in range(3):
                await client.async_execute_cell(nb.cells[index], index, execution_count=index + 1)
            busy = asyncio.ensure_future(client.async_execute_cell(nb.cells[3], 3, execution_count=4))
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"started-{rank}").exists() for rank in range(2)):
                assert time.monotonic() < deadline, "the call did not start"
                await asyncio.sleep(0.05)
            await manager.interrupt_kernel()
            await asyncio.wait_for(busy, timeout=30)
            await client.async_execute_cell(nb.cells[4], 4, execution_count=5)
        return facts

    facts = asyncio.run(scenario())
    nbformat.write(nb, tmp_path / "executed.ipynb")
    first = _result_line(nb.cells[1], "RESULT")
    pids = [pid for pid, _ in first]
    assert [count for _, count in first] == [1, 1], _outputs(nb.cells[1])
    assert _result_line(nb.cells[2], "RESULT") == [10, 10], _outputs(nb.cells[2])
    assert all(f"printed by rank {rank}" in _outputs(nb.cells[2]) for rank in range(2)), _outputs(nb.cells[2])
    assert [e.ename for e in _errors(nb.cells[3])] == ["KeyboardInterrupt"], _outputs(nb.cells[3])
    assert _result_line(nb.cells[4], "RESULT") == [[pid, 2] for pid in pids], _outputs(nb.cells[4])
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == [], "a rank outlived the kernel"
    _assert_no_launch_directories(facts["kernel_pid"])


def test_interactive_example_notebook_runs_top_to_bottom(tmp_path: Path) -> None:
    """examples/interactive.ipynb runs headless without an error: training across cells, live values."""
    nb = nbformat.read(Path(__file__).resolve().parents[2] / "examples" / "interactive.ipynb", as_version=4)
    _run(nb, tmp_path, own=False)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not _errors(cell), f"cell {index} failed:\n{_outputs(cell)}"
    text = "".join(_outputs(cell) for cell in nb.cells if cell.cell_type == "code")
    assert "rank 0 of 2 ready" in text, text
    assert "loss after 20 more" in text, text
    assert "step  90" in text, text
    assert "final loss" in text, text
