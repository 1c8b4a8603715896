"""``fn.submit()`` in a real Jupyter kernel: the cell returns at once, interrupting the kernel stops the launch
the cell waits on (only), and shutting the kernel down stops the one left."""

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
    _client,
    _errors,
    _kernel,
    _kernel_env,
    _notebook,
    _outputs,
    _result_line,
    _workers_of,
)

pytestmark = pytest.mark.slow

SLEEPY = """\
import time

@parallel(nprocs=2, grace_period=5)
def sleepy(tag, seconds):
    with open(f"{tag}-{worker_info().rank}.pid", "w") as file:
        file.write(str(os.getpid()))
    try:
        time.sleep(seconds)
    finally:
        open(f"{tag}-{worker_info().rank}.stopped", "w").close()

started = time.monotonic()
future = sleepy.submit("a", 300)
print("RESULT", json.dumps(time.monotonic() - started))
"""


async def _pids(tmp_path: Path, tag: str, launch: Any = None) -> list[int]:
    files = [tmp_path / f"{tag}-{rank}.pid" for rank in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in files):
        assert launch is None or not launch.done()
        assert time.monotonic() < deadline, "the workers did not start within 60 s"
        await asyncio.sleep(0.1)
    return [int(p.read_text()) for p in files]


@pytest.mark.timeout(240)
def test_submit_in_a_kernel_an_interrupt_stops_the_launch_its_cell_waits_on(tmp_path: Path) -> None:
    """Issue 37, item 8: interrupting any cell stopped every submitted launch. Interrupting a cell that waits on
    nothing leaves them running; interrupting one that waits on a launch stops that launch only; shutting the
    kernel down stops the one left."""
    nb = _notebook(
        IMPORTS,
        SLEEPY,
        'open("busy", "w").close()\ntime.sleep(120)',
        'later = sleepy.submit("b", 300)\nopen("waiting", "w").close()\nfuture.result()',
        """\
quick = sleepy.options(nprocs=1).submit("c", 0).result()
print("RESULT", json.dumps([future.cancelled(), later.running(), quick is None]))
""",
        tags={2: ["raises-exception"], 3: ["raises-exception"]},
    )
    client = _client(nb, tmp_path)
    manager: Any = None

    async def interrupted(index: int, mark: str) -> float:
        """Run cell ``index``, interrupt the kernel once it wrote ``mark``; return how long the cell took to end."""
        cell = asyncio.ensure_future(client.async_execute_cell(nb.cells[index], index, execution_count=index + 1))
        deadline = time.monotonic() + 60
        while not (tmp_path / mark).exists():  # the cell runs: the kernel is busy
            assert not cell.done(), _outputs(nb.cells[index])
            assert time.monotonic() < deadline, "the cell did not start within 60 s"
            await asyncio.sleep(0.05)
        if index == 3:
            facts["second"] = await _pids(tmp_path, "b")
        started = time.monotonic()
        await manager.interrupt_kernel()
        await asyncio.wait_for(cell, timeout=30)
        return time.monotonic() - started

    facts: dict[str, Any] = {}

    async def scenario() -> None:
        nonlocal manager
        async with client.async_setup_kernel(env=_kernel_env(tmp_path)):
            manager, facts["kernel_pid"] = _kernel(client)
            await client.async_execute_cell(nb.cells[0], 0, execution_count=1)
            await client.async_execute_cell(nb.cells[1], 1, execution_count=2)
            facts["first"] = await _pids(tmp_path, "a")
            await interrupted(2, "busy")
            facts["alive_after_idle_interrupt"] = [pid for pid in facts["first"] if _alive(pid)]
            facts["stop_seconds"] = await interrupted(3, "waiting")
            facts["alive_after_interrupt"] = [pid for pid in facts["first"] if _alive(pid)]
            facts["second_alive"] = [pid for pid in facts["second"] if _alive(pid)]
            await client.async_execute_cell(nb.cells[4], 4, execution_count=5)

    asyncio.run(scenario())
    nbformat.write(nb, tmp_path / "executed.ipynb")
    assert _result_line(nb.cells[1], "RESULT") < 5, _outputs(nb.cells[1])  # submit returned at once
    assert [e.ename for e in _errors(nb.cells[2])] == ["KeyboardInterrupt"], _outputs(nb.cells[2])
    assert facts["alive_after_idle_interrupt"] == facts["first"], facts  # a cell that waited on nothing
    assert [e.ename for e in _errors(nb.cells[3])] == ["KeyboardInterrupt"], _outputs(nb.cells[3])
    assert facts["stop_seconds"] < 15, facts
    assert facts["alive_after_interrupt"] == [], facts  # the launch the cell waited on
    assert facts["second_alive"] == facts["second"], facts  # not the one it started
    assert all((tmp_path / f"a-{rank}.stopped").exists() for rank in range(2))  # SIGTERM: finally blocks ran
    assert _result_line(nb.cells[4], "RESULT") == [True, True, True], _outputs(nb.cells[4])
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in facts["second"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in facts["second"] if _alive(pid)] == [], "a worker outlived the kernel"
    assert all((tmp_path / f"b-{rank}.stopped").exists() for rank in range(2))  # stopped at exit, not killed
    assert not _alive(facts["kernel_pid"]) or _workers_of(facts["kernel_pid"]) == []
