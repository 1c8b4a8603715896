"""The CUDA driver's state, read for real on a machine without one: a stand-in ``libcuda.so.1`` built here
answers as the driver does (``cuDeviceGetCount``: CUDA_ERROR_NOT_INITIALIZED until ``cuInit``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mplaunch._platform import cuda
from tests.helpers import run_script, stand_in_cuda_driver, write_script


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in driver with 2 devices, found through ``LD_LIBRARY_PATH`` by processes started from here."""
    folder = stand_in_cuda_driver(tmp_path)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(folder))
    return folder


STATES = """
    import ctypes
    from mplaunch._platform import cuda

    print("not loaded:", cuda.driver_initialised())
    driver = ctypes.CDLL("libcuda.so.1")
    print("loaded:", cuda.driver_initialised())
    driver.cuInit(0)
    print("after cuInit:", cuda.driver_initialised())
"""


def test_the_driver_state_is_read_without_initialising_it(driver: Path, tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, STATES))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["not loaded: False", "loaded: False", "after cuInit: True"]


def test_devices_are_counted_through_the_driver_in_another_process(driver: Path) -> None:
    cuda.driver_device_count.cache_clear()
    try:
        assert cuda.driver_device_count(os.environ["LD_LIBRARY_PATH"]) == 2
    finally:
        cuda.driver_device_count.cache_clear()
    assert not cuda.driver_initialised()  # not here


PROBE_THEN_LAUNCH = """
    import ctypes
    import sys
    import warnings

    import mplaunch

    def one() -> int:
        return 1

    if __name__ == "__main__":
        ctypes.CDLL("libcuda.so.1").cuInit(0)  # as torch.cuda.is_available() does, through the CUDA runtime
        try:
            mplaunch.parallel(nprocs=1, start_method="fork", timeout=60)(one)()
        except mplaunch.LaunchRefusedError as error:
            print("refused:", error)
        sys.ps1 = ">>> "  # as in a notebook or the REPL, whose default is fork
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            print("default:", mplaunch.parallel(nprocs=1, timeout=100)(one)())
        print("said:", [str(warning.message) for warning in said])
"""


def test_after_cuinit_fork_is_refused_and_the_interactive_default_spawns(driver: Path, tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, PROBE_THEN_LAUNCH), timeout=110)
    assert done.returncode == 0, done.stderr
    assert "refused: start_method='fork' cannot be used: the CUDA driver is initialised in this process" in done.stdout
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in done.stdout
    assert "default: 1" in done.stdout
    assert "workers start with spawn here, not fork: the CUDA driver is initialised" in done.stdout
