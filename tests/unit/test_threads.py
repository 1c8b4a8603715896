"""The thread policy for workers, and freeing OpenMP pools before fork, in one process."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from mplaunch._parent import policy
from mplaunch._platform import openmp


def test_torchs_openmp_runtime_is_found_and_its_pool_released() -> None:
    import torch

    torch.randn(10**6).exp().sum()
    runtimes = openmp.loaded_runtimes()
    assert any("gomp" in library._name or "omp" in Path(library._name).name for library in runtimes), runtimes
    assert openmp.release_pools()


def test_users_thread_count_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert policy.wanted_threads(8) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 8)
    assert policy.wanted_threads(2) == 4
    assert policy.wanted_threads(16) == 1


def test_an_unreleasable_pool_means_one_thread_and_a_warning_at_the_callers_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 4)
    monkeypatch.setattr(openmp, "release_pools", lambda: False)
    monkeypatch.setattr(policy, "_warned", False)
    assert policy.worker_threads(2, "spawn") == 2  # nothing to release for a fresh interpreter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.worker_threads(2, "fork") == 1
        assert policy.worker_threads(2, "fork") == 1
    assert len(caught) == 1  # once
    assert caught[0].filename == __file__  # pointing here, not into mplaunch
    assert "could not be released" in str(caught[0].message)


def test_forked_workers_keep_their_share_when_the_pool_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 8)
    released: list[bool] = []

    def release() -> bool:
        released.append(True)
        return True

    monkeypatch.setattr(openmp, "release_pools", release)
    assert policy.worker_threads(2, "fork") == 4
    assert released == [True]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert policy.worker_threads(2, "fork") == 1
    assert released == [True]  # one thread: nothing to release


class _Runtime:
    """A stand-in for a loaded runtime's ctypes library."""

    def __init__(self, result: int | None) -> None:
        self.calls: list[int] = []
        if result is not None:

            def pause(kind: int) -> int:
                self.calls.append(kind)
                return result

            self.omp_pause_resource_all: Any = pause


@pytest.mark.parametrize(("result", "released"), [(0, True), (-1, False), (None, False)])
def test_every_runtime_must_free_its_pool(monkeypatch: pytest.MonkeyPatch, result: int | None, released: bool) -> None:
    """``omp_pause_resource_all`` returns 0 on success; a runtime without it (``None``) cannot be paused."""
    first, second = _Runtime(0), _Runtime(result)
    monkeypatch.setattr(openmp, "_scanned", (len(sys.modules), [first, second]))
    assert openmp.release_pools() is released
    assert first.calls == [2]  # omp_pause_hard: the pool's threads end
