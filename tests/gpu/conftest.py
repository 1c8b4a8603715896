"""The GPU check's fixtures: ``nvidia-smi`` for the memory checks, and a check after each test that this process,
the parent of every launch, never initialised CUDA's driver."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from mplaunch._platform import cuda


@pytest.fixture
def smi() -> None:
    """Skip without ``nvidia-smi`` (the memory checks read it)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH: GPU memory cannot be read without initialising CUDA here")


@pytest.fixture(autouse=True)
def parent_never_initialises_cuda() -> Iterator[None]:
    yield
    assert not torch.cuda.is_initialized(), "CUDA was initialised in the parent"
    assert not cuda.driver_initialised(), "the CUDA driver was initialised (cuInit) in the parent"
