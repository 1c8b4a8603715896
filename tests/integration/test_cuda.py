"""CUDA behaviour; skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mplaunch import parallel
from tests import workers
from tests.helpers import run_script, write_script

pytestmark = pytest.mark.cuda


def test_cuda_tensors_come_back_on_the_cpu() -> None:
    result = parallel(nprocs=1, start_method="spawn", timeout=120)(workers.cuda_result)()
    assert result["tensor"].device.type == "cpu"
    assert result["tensor"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert result["module"].weight.device.type == "cpu"
    assert result["big"].device.type == "cpu"
    assert not torch.cuda.is_initialized()  # the parent never touched CUDA


def test_probing_cuda_leaves_fork_allowed() -> None:
    """is_available() and device_count() on a machine with CUDA do not initialise it: fork still works."""
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() >= 1
    assert not torch.cuda.is_initialized()
    assert parallel(nprocs=1, start_method="fork", timeout=120)(workers.identity)(7) == ((7,), {})


CUDA_THEN_FORK = """
    import torch
    import mplaunch

    @mplaunch.parallel(nprocs=1, start_method="fork", timeout=60)
    def work() -> int:
        return 1

    if __name__ == "__main__":
        mplaunch.record_cuda_init()
        x = torch.ones(1, device="cuda")
        try:
            work()
        except mplaunch.LaunchRefusedError as error:
            print("refused:", error)
"""


def test_fork_after_cuda_is_refused_with_where(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, CUDA_THEN_FORK))
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout
    assert "CUDA was first initialised here" in done.stdout
    assert 'x = torch.ones(1, device="cuda")' in done.stdout


def test_cuda_results_keep_their_storage_sharing() -> None:
    """Issue 11: tensors that share one CUDA storage came back as separate copies (one device-to-host copy per
    tensor); each storage is now copied once, and views and tied weights share it in the parent."""
    result = parallel(nprocs=1, start_method="spawn", timeout=120)(workers.tied_result)("cuda")
    base, view = result["base"], result["view"]
    assert base.device.type == "cpu"
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert result["head"].weight is result["embedding"].weight or (
        result["head"].weight.data_ptr() == result["embedding"].weight.data_ptr()
    )
