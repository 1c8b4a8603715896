"""A container's small /dev/shm (issue 21): results the caller keeps hold none of it, and arguments and results
larger than it travel through anonymous memory files."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mplaunch import StartMethod, parallel
from mplaunch._parent import memory
from mplaunch._wire import fds
from tests import workers

_TMPFS_MIB = 16


def _has_memory_files() -> bool:
    fd = fds.memory_file("probe")
    fds.close_quietly(fd)
    return fd is not None


def _used(root: str) -> int:
    stats = os.statvfs(root)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real 16 MiB tmpfs as mplaunch's shared-memory directory (``MPLAUNCH_SHM_DIR``), as Docker's /dev/shm."""
    root = tmp_path / "shm"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={_TMPFS_MIB}m", "tmpfs", str(root)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        monkeypatch.setenv("MPLAUNCH_SHM_DIR", str(root))
        yield str(root)
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(root)], check=False, timeout=30)


@pytest.mark.parametrize("memory_files", [True, False], ids=["memfd", "files"])
def test_kept_results_hold_no_shared_memory(
    small_shm: str, memory_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep that keeps each trial's 5 MiB result failed on the 4th call with "No space left" in a 16 MiB
    /dev/shm: the results were mapped from unlinked files, which stay charged while mapped. With memory files
    they never touch it; without (``files``) the parent copies them into its own memory."""
    if not memory_files:
        monkeypatch.setattr(memory, "memory_file", lambda name: None)
    elif not _has_memory_files():
        pytest.skip("no memfd_create here")
    trial = parallel(nprocs=1, start_method="fork", timeout=120)(workers.big_result)
    kept = []
    for _ in range(6):
        kept.append(trial(5)["tensor"])
        assert _used(small_shm) < 2**20, f"{_used(small_shm)} bytes of the tmpfs still used after the call"
    assert all(float(t[-1]) == 5 * 2**18 - 1 for t in kept)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_arguments_and_results_larger_than_shared_memory(small_shm: str, start_method: StartMethod) -> None:
    """32 MiB in and out through a 16 MiB /dev/shm: raw torch.multiprocessing fails ("Bus error"), and so did
    mplaunch ("No space left"; the error asked for --shm-size)."""
    if not _has_memory_files():
        pytest.skip("no memfd_create here")
    big = torch.ones(8 * 2**20)  # 32 MiB
    (back,), _ = parallel(nprocs=2, start_method=start_method, timeout=120)(workers.identity)(big)
    assert back.numel() == big.numel() and float(back.sum()) == big.numel()
    assert _used(small_shm) < 2**20
