"""A parent that is itself a bad CUDA fork, on a machine with a CUDA device, is refused under fork."""

from __future__ import annotations

import pytest
import torch

from mplaunch import LaunchRefusedError
from mplaunch._parent import checks, devices


def test_a_bad_cuda_fork_refuses_fork_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # as torch says in a bad fork
    monkeypatch.setattr(devices, "device_count", lambda: 1)  # without one it may fork: test_cuda_probes.py
    with pytest.raises(LaunchRefusedError, match="forked from a process that had initialised CUDA"):
        checks.check_cuda_fork("fork")
    checks.check_cuda_fork("spawn")
    checks.check_cuda_fork("forkserver")
