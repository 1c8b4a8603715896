"""The thread policy for workers, in one process."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from mplaunch._parent import policy


def test_openmp_runtimes_are_found_in_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 fd:00 1 /venv/torch/lib/libgomp.so.1\n"
        "7f01-7f02 r--p 00001000 fd:00 1 /venv/torch/lib/libgomp.so.1\n"
        "7f02-7f03 r-xp 00000000 fd:00 2 /venv/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0\n"
        "7f03-7f04 r-xp 00000000 fd:00 3 /opt/intel/lib/libiomp5.so\n"
        "7f04-7f05 r-xp 00000000 fd:00 4 /usr/lib/libgompish_not_a_runtime/x.so\n"
        "7f05-7f06 r-xp 00000000 fd:00 5 /usr/lib/libopenblas.so.0\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
    )
    assert policy._loaded_runtimes(str(maps)) == [
        "/venv/torch/lib/libgomp.so.1",
        "/venv/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0",
        "/opt/intel/lib/libiomp5.so",
    ]


def test_the_pool_of_this_process_can_be_released() -> None:
    import torch

    torch.randn(10**6).exp().sum()
    assert policy._loaded_runtimes(), "torch's wheel maps an OpenMP runtime"
    assert policy.release_openmp_pools()


def test_users_thread_count_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert policy.wanted_threads(8) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 8)
    assert policy.wanted_threads(2) == 4 and policy.wanted_threads(16) == 1


def test_an_unreleasable_pool_means_one_thread_and_a_warning_at_the_callers_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 4)
    monkeypatch.setattr(policy, "release_openmp_pools", lambda: False)
    monkeypatch.setattr(policy, "_warned", False)
    assert policy.worker_threads(2, "spawn") == 2  # nothing to release for a fresh interpreter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy.worker_threads(2, "fork") == 1
        assert policy.worker_threads(2, "fork") == 1
    assert len(caught) == 1 and caught[0].filename == __file__  # once, pointing here, not into mplaunch
    assert "could not be released" in str(caught[0].message)


def test_forked_workers_keep_their_share_when_the_pool_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(policy, "usable_cpu_count", lambda: 8)
    released: list[bool] = []

    def release() -> bool:
        released.append(True)
        return True

    monkeypatch.setattr(policy, "release_openmp_pools", release)
    assert policy.worker_threads(2, "fork") == 4 and released == [True]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert policy.worker_threads(2, "fork") == 1 and released == [True]  # one thread: nothing to release


@pytest.mark.parametrize(("result", "released"), [(0, True), (-1, False), (None, False)])
def test_every_runtime_must_free_its_pool(monkeypatch: pytest.MonkeyPatch, result: int | None, released: bool) -> None:
    """``omp_pause_resource_all`` returns 0 on success; a runtime without it (``None``) cannot be paused."""
    calls: list[tuple[str, int]] = []

    def pauser(path: str) -> Callable[[int], int] | None:
        def pause(kind: int) -> int:
            calls.append((path, kind))
            return 0 if path.endswith("libgomp.so.1") else (result or 0)

        return None if result is None and path.endswith("libiomp5.so") else pause

    monkeypatch.setattr(policy, "_scanned", (len(sys.modules), ["/lib/libgomp.so.1", "/lib/libiomp5.so"]))
    monkeypatch.setattr(policy, "_pauser", pauser)
    assert policy.release_openmp_pools() is released
    assert calls[0] == ("/lib/libgomp.so.1", 2)  # omp_pause_hard: the pool's threads end


def test_a_runtime_is_paused_only_if_this_process_loaded_it(tmp_path: Path) -> None:
    import torch

    torch.randn(10**5).exp().sum()
    loaded = next(path for path in policy._loaded_runtimes() if "torch" in path)
    assert policy._pauser(loaded) is not None
    copy = tmp_path / "libgomp.so.1"
    copy.write_bytes(Path(loaded).read_bytes())
    assert policy._pauser(str(copy)) is None  # another file, never loaded: RTLD_NOLOAD does not open it
    assert str(copy) not in policy._loaded_runtimes()
