"""A notebook whose first cell probed CUDA: in a real kernel, after ``cuInit`` (what ``torch.cuda.is_available()``
runs on a GPU machine; here a stand-in driver's), the default start method is spawn, said once, a function of a
cell still runs, and an explicit fork is refused with the cause and the fixes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from tests.helpers import REPO, stand_in_cuda_driver  # noqa: E402
from tests.notebooks.kernels import IMPORTS, _notebook, _outputs, _result_line, _run, _text  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc and process groups: Linux"),
]


@pytest.mark.timeout(150)
def test_after_a_probe_the_kernel_launches_with_spawn_and_refuses_fork(tmp_path: Path) -> None:
    nb = _notebook(
        IMPORTS,
        """\
import ctypes
ctypes.CDLL("libcuda.so.1").cuInit(0)  # what torch.cuda.is_available() runs on a GPU machine
""",
        """\
@parallel(nprocs=2, timeout=100, return_all=True)
def where():
    cmdline = open("/proc/self/cmdline").read().replace("\\0", " ")
    return "ipykernel_launcher" in cmdline

print("FORKED", json.dumps(where()))
print("AGAIN", json.dumps(where()))
""",
        """\
try:
    parallel(nprocs=1, start_method="fork", timeout=60)(where)()
except mplaunch.LaunchRefusedError as error:
    print("REFUSED", json.dumps(str(error)))
""",
    )
    _run(nb, tmp_path, LD_LIBRARY_PATH=str(stand_in_cuda_driver(tmp_path)), PYTHONPATH=str(REPO))  # this checkout
    launched, refused = nb.cells[2], nb.cells[3]
    assert _result_line(launched, "FORKED") == [False, False], _outputs(launched)  # spawned: a fresh interpreter
    assert _result_line(launched, "AGAIN") == [False, False]
    said = _text(launched, "stderr")
    assert said.count("workers start with spawn here, not fork: the CUDA driver is initialised") == 1, said
    message = _result_line(refused, "REFUSED")
    assert "the CUDA driver is initialised in this process" in message
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in message
    assert "restart the kernel" in message
