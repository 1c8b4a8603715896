"""Ranks of a launch in a real Jupyter kernel driven as JupyterLab drives it: with jupyter_client directly
(not nbclient), because Jupyter's own front ends allow stdin (``allow_stdin=True``) and interrupt an idle
kernel, which nbclient never does."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from tests.notebooks.kernels import _assert_no_launch_directories, _kernel_env, _workers_of

pytestmark = pytest.mark.slow

IMPORTS = "import os, time\nimport mplaunch\nfrom mplaunch import parallel, worker_info, Workers\n"


class Kernel:
    """A kernel of this interpreter in ``cwd``, run cell by cell, as JupyterLab drives it (stdin allowed)."""

    def __init__(self, cwd: Path, *, allow_stdin: bool = True) -> None:
        self.manager = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
        self.manager.start_kernel(env=_kernel_env(cwd), cwd=str(cwd))
        self.client = self.manager.client()
        self.client.allow_stdin = allow_stdin
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        provisioner = self.manager.provisioner
        self.pid: int = provisioner.pid  # type: ignore[union-attr]

    def send(self, code: str) -> str:
        return str(self.client.execute(code))

    def outputs(self, msg_id: str, timeout: float = 90) -> dict[str, Any]:
        """The cell's stdout, stderr and error name once the kernel is idle again."""
        found: dict[str, Any] = {"stdout": "", "stderr": "", "error": None}
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the cell did not end within {timeout} s: {found}") from None
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                found[content["name"]] += content["text"]
            elif kind == "error":
                found["error"] = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                return found

    def run(self, code: str, timeout: float = 90) -> dict[str, Any]:
        return self.outputs(self.send(code), timeout)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    started = Kernel(tmp_path)
    try:
        yield started
    finally:
        pid = started.pid
        started.close()
        _assert_no_launch_directories(pid)


def _wait_for(paths: list[Path], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not created within {timeout} s: {paths}"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_breakpoint_in_a_fork_rank_of_a_kernel_prints_guidance(kernel: Kernel) -> None:
    """ipykernel sets ``sys.breakpointhook`` (debugpy's); a fork rank inherits it. mplaunch took it for the
    user's own hook and left it, and ``breakpoint()`` did nothing, silently. Under spawn the rank
    prints the promised guidance ("breakpoint() in rank N skipped ... fn.debug(...)")."""
    kernel.run(IMPORTS)
    cell = kernel.run(
        """\
@parallel(nprocs=2, timeout=60)  # fork: the notebook default
def stop_here():
    breakpoint()
    return 1

print("RESULT", stop_here())
"""
    )
    assert "RESULT 1" in cell["stdout"], cell
    assert "breakpoint() in rank 0 skipped" in cell["stderr"], cell  # it printed nothing


@pytest.mark.timeout(180)
def test_input_in_a_fork_rank_does_not_hang_a_kernel_that_allows_stdin(kernel: Kernel) -> None:
    """JupyterLab allows stdin. ``input()`` in a fork rank calls ipykernel's ``raw_input`` copied
    into the child: no input box reaches the front end, and the call hangs until ``timeout`` (forever without
    one). Under spawn the rank gets EOFError at once. The fix: an error at once, under fork too (here: well
    before the timeout)."""
    kernel.run(IMPORTS)
    started = time.monotonic()
    msg_id = kernel.send(
        """\
@parallel(nprocs=1, timeout=40)
def ask():
    return input("give: ")

try:
    print("RESULT", ask())
except BaseException as error:
    print("RAISED", type(error).__name__)
"""
    )
    with pytest.raises(queue.Empty):  # no input box is shown for the rank: none must be, or it must be answered
        request = kernel.client.get_stdin_msg(timeout=1)
        kernel.client.input("typed")
        raise AssertionError(f"an input box was shown and answered: {request['content']}")
    cell = kernel.outputs(msg_id)
    assert "LaunchTimeoutError" not in cell["stdout"], cell  # it was RAISED LaunchTimeoutError after 40 s
    assert time.monotonic() - started < 30, cell


@pytest.mark.timeout(240)
def test_interrupting_an_idle_kernel_does_not_fail_a_workers_submit_as_an_exit(kernel: Kernel, tmp_path: Path) -> None:
    """Interrupt an idle kernel (Jupyter's button sends SIGINT to its process group) while
    ``workers.submit()`` runs. ``fn.submit()`` keeps running there, but the warm call failed with
    ``WorkerExitedError: rank 1 (pid N) raised KeyboardInterrupt() before returning, so it has no result
    (exit code 130)``: the rank did not exit (the same pids serve the next call). The fix: as ``fn.submit()``
    (the call goes on), or a cancelled call; never an exit that did not happen."""
    kernel.run(IMPORTS)
    kernel.run(
        """\
def sleeper(tag):
    open(f"{tag}-{worker_info().rank}", "w").close()
    time.sleep(30)
    return "slept"

workers = Workers(nprocs=2, timeout=120)
pids = workers.pids
warm = workers.submit(sleeper, "warm")
cold = parallel(nprocs=2, timeout=120)(sleeper).submit("cold")
"""
    )
    _wait_for([tmp_path / f"{tag}-{rank}" for tag in ("warm", "cold") for rank in range(2)])
    time.sleep(0.5)  # in time.sleep(30)
    kernel.manager.interrupt_kernel()
    time.sleep(3)
    cell = kernel.run(
        """\
print("COLD", cold.running())
error = warm.exception(timeout=0) if warm.done() else None
print("WARM", type(error).__name__, error)
print("SAME", workers.pids == pids)
cold.cancel(); warm.cancel(); workers.close()
"""
    )
    assert "COLD True" in cell["stdout"], cell
    assert "SAME True" in cell["stdout"], cell
    assert "WorkerExitedError" not in cell["stdout"], cell  # it was WARM WorkerExitedError ... (exit code 130)
    assert _workers_of(kernel.pid) == [], "workers left"


@pytest.mark.timeout(120)
def test_a_spawn_launch_in_a_kernel_does_not_warn_about_the_kernels_own_handler(kernel: Kernel) -> None:
    """the first spawn launch of each cell warns that workers do not get "logging.StreamHandler
    to <_io.TextIOWrapper name=44> on logger 'IPKernelApp'": ipykernel's own handler, which the user never set
    and needs in no rank. The fix: no warning for the kernel's own logging."""
    kernel.run(IMPORTS)
    cell = kernel.run(
        'print("RESULT", parallel(nprocs=1, timeout=60, start_method="spawn")(os.getpid)() != os.getpid())'
    )
    assert "RESULT True" in cell["stdout"], cell
    assert "IPKernelApp" not in cell["stderr"], cell
