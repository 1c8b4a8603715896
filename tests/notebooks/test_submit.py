"""``fn.submit()`` in a real Jupyter kernel: the cell returns at once, interrupting the kernel (while another
cell runs) stops the running launch, and shutting the kernel down stops the one started after."""

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
def test_submit_in_a_kernel_interrupt_and_shutdown_stop_the_launches(tmp_path: Path) -> None:
    nb = _notebook(
        IMPORTS,
        SLEEPY,
        'open("busy", "w").close()\ntime.sleep(120)',
        """\
later = sleepy.submit("b", 300)
print("RESULT", json.dumps([future.cancelled(), sleepy.options(nprocs=1).submit("c", 0).result() is None]))
""",
        tags={2: ["raises-exception"]},
    )
    client = _client(nb, tmp_path)

    async def scenario() -> dict[str, Any]:
        facts: dict[str, Any] = {}
        async with client.async_setup_kernel(env=_kernel_env(tmp_path)):
            manager, kernel_pid = _kernel(client)
            await client.async_execute_cell(nb.cells[0], 0, execution_count=1)
            await client.async_execute_cell(nb.cells[1], 1, execution_count=2)
            facts["first"] = await _pids(tmp_path, "a")
            busy = asyncio.ensure_future(client.async_execute_cell(nb.cells[2], 2, execution_count=3))
            deadline = time.monotonic() + 60
            while not (tmp_path / "busy").exists():  # the cell runs: the kernel is busy
                assert not busy.done(), _outputs(nb.cells[2])
                assert time.monotonic() < deadline, "the cell did not start within 60 s"
                await asyncio.sleep(0.05)
            interrupted = time.monotonic()
            await manager.interrupt_kernel()
            await asyncio.wait_for(busy, timeout=30)
            facts["stop_seconds"] = time.monotonic() - interrupted
            facts["alive_after_interrupt"] = [pid for pid in facts["first"] if _alive(pid)]
            await client.async_execute_cell(nb.cells[3], 3, execution_count=4)
            facts["second"] = await _pids(tmp_path, "b")
            facts["kernel_pid"] = kernel_pid
        return facts

    facts = asyncio.run(scenario())
    nbformat.write(nb, tmp_path / "executed.ipynb")
    assert _result_line(nb.cells[1], "RESULT") < 5, _outputs(nb.cells[1])  # submit returned at once
    assert [e.ename for e in _errors(nb.cells[2])] == ["KeyboardInterrupt"], _outputs(nb.cells[2])
    assert facts["stop_seconds"] < 15, facts
    assert facts["alive_after_interrupt"] == [], facts
    assert all((tmp_path / f"a-{rank}.stopped").exists() for rank in range(2))  # SIGTERM: finally blocks ran
    assert _result_line(nb.cells[3], "RESULT") == [True, True], _outputs(nb.cells[3])
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in facts["second"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in facts["second"] if _alive(pid)] == [], "a worker outlived the kernel"
    assert all((tmp_path / f"b-{rank}.stopped").exists() for rank in range(2))  # stopped at exit, not killed
    assert not _alive(facts["kernel_pid"]) or _workers_of(facts["kernel_pid"]) == []
