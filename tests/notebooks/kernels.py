"""Helpers for the notebook tests (tests/notebooks/test_*.py): a kernel that runs this interpreter, notebooks
built with nbformat and run with nbclient, and reading the cells' outputs.

Which Python runs the kernel: :class:`_VenvKernelManager` ignores every installed kernelspec (user, venv,
system) and uses the "native" spec that ipykernel builds from ``sys.executable``, so the kernel is always
the interpreter running pytest (the project's venv), whatever kernels the machine has installed, and the
tests install nothing. The kernel runs in ``tmp_path`` with ``IPYTHONDIR`` there too.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
psutil = pytest.importorskip("psutil")

import nbformat  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from jupyter_client.provisioning.local_provisioner import LocalProvisioner  # noqa: E402
from nbclient import NotebookClient  # noqa: E402
from nbformat import NotebookNode  # noqa: E402
from traitlets import default  # noqa: E402

#: Seconds one cell may run before nbclient fails the test (a launch here takes 1-15 s on 2 slow cores).
CELL_TIMEOUT = 90
#: Seconds a kernel may take to start.
STARTUP_TIMEOUT = 60


class _VenvKernelManager(AsyncKernelManager):
    """A kernel manager whose ``python3`` kernel is always ``sys.executable -m ipykernel_launcher``.

    With no kernel directories, jupyter_client's spec manager finds no installed ``python3`` spec and falls
    back to the native one built by ``ipykernel.kernelspec.get_kernel_dict()`` from ``sys.executable``.
    """

    @default("kernel_spec_manager")
    def _kernel_spec_manager_default(self) -> KernelSpecManager:
        return KernelSpecManager(kernel_dirs=[])


def _kernel_env(tmp_path: Path, **overrides: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["IPYTHONDIR"] = str(tmp_path / ".ipython")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTEST_CURRENT_TEST", None)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _notebook(*sources: str, tags: dict[int, list[str]] | None = None) -> NotebookNode:
    nb: NotebookNode = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    for index, cell_tags in (tags or {}).items():
        nb.cells[index].metadata["tags"] = cell_tags
    return nb


def _client(nb: NotebookNode, tmp_path: Path, *, timeout: int = CELL_TIMEOUT) -> NotebookClient:
    return NotebookClient(
        nb,
        timeout=timeout,
        startup_timeout=STARTUP_TIMEOUT,
        kernel_name="python3",
        kernel_manager_class=_VenvKernelManager,
        resources={"metadata": {"path": str(tmp_path)}},
    )


def _kernel(client: NotebookClient) -> tuple[AsyncKernelManager, int]:
    """The manager and pid of the kernel that ``client`` started (nbclient types both as optional)."""
    manager = client.km
    assert isinstance(manager, AsyncKernelManager)
    provisioner = manager.provisioner
    assert isinstance(provisioner, LocalProvisioner)
    assert provisioner.pid is not None
    return manager, provisioner.pid


def _run(nb: NotebookNode, tmp_path: Path, *, own: bool = True, **env: str | None) -> NotebookNode:
    """Execute every cell of ``nb`` in a fresh kernel in ``tmp_path``; the kernel is shut down after.

    ``own``: the notebook starts with ``IMPORTS``, which prints the kernel's pid; then check that the
    kernel's launches left no launch directory behind."""
    nbformat.validate(nb)
    client = _client(nb, tmp_path)
    asyncio.run(client.async_execute(env=_kernel_env(tmp_path, **env)))
    nbformat.write(nb, tmp_path / "executed.ipynb")  # kept for a look when a test fails
    if own:
        _assert_no_launch_directories(_result_line(nb.cells[0], "KERNEL_PID"))
    return nb


def _assert_no_launch_directories(kernel_pid: int) -> None:
    """Every launch of the kernel removed its directory (``mplaunch-<pid>-*`` in /dev/shm or the temp dir)."""
    left = []
    for root in {"/dev/shm", tempfile.gettempdir()}:
        if os.path.isdir(root):
            left += [os.path.join(root, e) for e in os.listdir(root) if e.startswith(f"mplaunch-{kernel_pid}-")]
    assert not left, f"launch directories left by the kernel: {left}"


def _text(cell: NotebookNode, stream: str = "stdout") -> str:
    """Everything ``cell`` wrote to ``stream`` (stdout/stderr), joined."""
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream" and out.name == stream)


def _result_line(cell: NotebookNode, tag: str) -> Any:
    """The JSON value printed by the cell as ``<tag> <json>`` on a line of its own."""
    for line in _text(cell).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    raise AssertionError(f"no line starting with {tag!r} in the cell's output:\n{_outputs(cell)}")


def _outputs(cell: NotebookNode) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(f"[{out.name}] {out.text}")
        elif out.output_type == "error":
            parts.append("[error] " + "\n".join(out.traceback))
        else:
            parts.append(f"[{out.output_type}] {out.get('data', {}).get('text/plain', '')}")
    return "".join(parts)


def _errors(cell: NotebookNode) -> list[NotebookNode]:
    return [out for out in cell.outputs if out.output_type == "error"]


IMPORTS = f"""\
import json, os, sys
import torch
import mplaunch
from mplaunch import parallel, worker_info
assert sys.executable == {sys.executable!r}, sys.executable
print("KERNEL_PID", os.getpid())
"""


def _workers_of(pid: int) -> list[Any]:
    """Live descendants of the kernel, but multiprocessing's long-lived helpers (resource tracker, fork
    server) and mplaunch's reaper of the kernel's launch directories, which are not workers."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append(child)  # an unreaped worker is a leak too
                continue
            args = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        cmdline = " ".join(args)
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        if args and args[-1].startswith(f"mplaunch-{pid}-"):  # the reaper: its last argument is the kernel's prefix
            continue
        found.append(child)
    return found


def _asleep(pid: int) -> bool:
    """Whether ``pid`` is in an interruptible sleep (as in ``time.sleep``)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_SLEEPING)
    except psutil.NoSuchProcess:
        return False


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
