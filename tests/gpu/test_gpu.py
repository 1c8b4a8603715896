"""The GPU check: ``make gpu-check`` runs this file on a machine with a GPU (skipped by the suite without one).
This process, the parent of every launch, never initialises CUDA (``conftest.py`` checks it after each test)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from mplaunch import InvalidOptionError, LaunchTimeoutError, StartMethod, WorkerExitedError, parallel
from mplaunch._parent import devices
from tests import gpu_workers, workers
from tests.gpu.smi import seconds_until_freed, total_mib, used_mib
from tests.helpers import run_script, write_script

pytestmark = pytest.mark.cuda

MIB = 1 << 20


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_cuda_values_come_back_on_the_cpu(start_method: str) -> None:
    """Under fork too: this process counted its devices through NVML (tests/conftest.py), which leaves the
    driver alone, so forked ranks can use CUDA."""
    run = parallel(nprocs=1, start_method=start_method, timeout=120)(gpu_workers.cuda_values)  # type: ignore[call-overload]
    result = run(256 * MIB)
    assert result["tensor"].device.type == "cpu"
    assert result["tensor"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert result["module"].weight.device.type == "cpu"
    assert result["big"].device.type == "cpu"
    assert result["big"].numel() == 256 * MIB
    assert int(result["big"][-1]) == 7


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_seed_seeds_each_ranks_cuda_generator(start_method: StartMethod) -> None:
    """seed= seeds torch's CUDA generators too (lazily, through torch.manual_seed), with (seed, rank)."""
    run = parallel(nprocs=2, start_method=start_method, timeout=120, return_all=True, seed=3)(gpu_workers.cuda_draw)
    draws = run(3)
    assert [draw for draw, expected in draws] == [expected for draw, expected in draws]
    assert draws[0][0] != draws[1][0]


def test_cuda_results_keep_their_storage_sharing() -> None:
    """Tensors that share one CUDA storage come back sharing one CPU storage (one copy per storage)."""
    result = parallel(nprocs=1, start_method="spawn", timeout=120)(workers.tied_result)("cuda")
    base, view = result["base"], result["view"]
    assert base.device.type == "cpu"
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert result["head"].weight.data_ptr() == result["embedding"].weight.data_ptr()


CONTEXT_THEN_FORK = """
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


def test_fork_after_a_cuda_context_is_refused_saying_where(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, CONTEXT_THEN_FORK))
    assert done.returncode == 0, done.stderr
    assert "refused: start_method='fork' cannot be used: CUDA is already initialised" in done.stdout
    assert 'x = torch.ones(1, device="cuda")' in done.stdout


PROBE_THEN_LAUNCH = """
    import sys
    import warnings

    import torch
    import mplaunch

    def device() -> str:
        return str(torch.ones(1, device="cuda").device)

    if __name__ == "__main__":
        mplaunch.record_cuda_init()
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            mplaunch.parallel(nprocs=1, start_method="fork", timeout=60)(device)()
        except mplaunch.LaunchRefusedError as error:
            print("refused:", error)
        sys.ps1 = ">>> "  # as in a notebook or the REPL, whose default is fork
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            print("default:", mplaunch.parallel(nprocs=1, timeout=120)(device)())
        print("said:", [str(warning.message) for warning in said])
"""


def test_after_a_bare_probe_fork_is_refused_and_the_default_spawns(tmp_path: Path) -> None:
    """``torch.cuda.is_available()`` runs cuInit without a context: an explicit fork is refused with the
    cause, the line and the fixes; the interactive default starts with spawn, says why, and the rank uses CUDA."""
    done = run_script(write_script(tmp_path, PROBE_THEN_LAUNCH), timeout=110)
    assert done.returncode == 0, done.stderr
    assert "refused: start_method='fork' cannot be used: the CUDA driver is initialised" in done.stdout
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in done.stdout
    assert 'device_kind = "cuda" if torch.cuda.is_available() else "cpu"' in done.stdout
    assert "default: cuda:0" in done.stdout
    assert "spawn here, not fork: the CUDA driver is initialised" in done.stdout


NVML_PROBES_THEN_FORK = """
    import os

    import torch
    import mplaunch

    def device() -> str:
        return str(torch.ones(1, device="cuda").device)

    if __name__ == "__main__":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() asks NVML, as device_count() does
        assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
        print("fork:", mplaunch.parallel(nprocs=1, start_method="fork", timeout=60)(device)())
"""


def test_probes_through_nvml_leave_fork_working(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, NVML_PROBES_THEN_FORK))
    assert done.returncode == 0, done.stderr
    assert "fork: cuda:0" in done.stdout


def test_device_requests_queue_on_one_gpu_and_impossible_ones_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    name = devices.visible_names()[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", name)  # one GPU: every request waits for it
    explicit = parallel(nprocs=1, devices=[0], start_method="fork", timeout=120)(gpu_workers.device_used_for)
    any_one = parallel(nprocs=1, devices=1, start_method="fork", timeout=120)(gpu_workers.device_used_for)
    futures = [call.submit(1.0) for call in (explicit, any_one, explicit)]
    spans = sorted(future.result(timeout=120) for future in futures)
    assert [(visible, count) for visible, count, _, _ in spans] == [(name, 1)] * 3
    for (_, _, _, ended), (_, _, started, _) in zip(spans, spans[1:], strict=False):
        assert started >= ended - 0.05  # one at a time
    before = psutil.Process().children(recursive=True)
    beyond = max(5, len(devices.visible_names()))
    with pytest.raises(InvalidOptionError, match=rf"devices=\[{beyond}\] names device\(s\) \[{beyond}\]"):
        parallel(nprocs=1, devices=[beyond])(gpu_workers.allocate)(MIB)
    assert psutil.Process().children(recursive=True) == before  # refused before any worker


def test_ddp_with_gloo_on_cuda_tensors_two_ranks_on_one_gpu() -> None:
    run = parallel(nprocs=2, backend="gloo", start_method="fork", timeout=180, return_all=True)
    results = run(gpu_workers.ddp_step)()
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    assert all(r["summed"].tolist() == [3.0, 3.0, 3.0] for r in results)
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # the gradients were all-reduced


def test_nccl_with_one_rank_per_gpu() -> None:
    count = devices.device_count()
    run = parallel(nprocs="auto", backend="auto", start_method="fork", timeout=180, return_all=True)
    results = run(gpu_workers.ddp_step)()
    assert len(results) == count
    assert {r["backend"] for r in results} == {"nccl"}
    assert results[0]["summed"].tolist() == [count * (count + 1) / 2] * 3
    assert all(torch.equal(results[0]["weight"], r["weight"]) for r in results)


@pytest.mark.usefixtures("smi")
def test_a_ranks_out_of_memory_comes_back_as_itself_and_frees_the_gpu() -> None:
    baseline = used_mib()
    hold = min(10 * 1024, total_mib() // 4) * MIB
    run = parallel(nprocs=2, start_method="fork", timeout=120, grace_period=2.0)(gpu_workers.hold_then_oom)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        run(hold)
    assert caught.value.rank == 1  # type: ignore[attr-defined]
    assert "rank 1" in "".join(getattr(caught.value, "__notes__", []))
    print(f"GPU memory back {seconds_until_freed(baseline):.1f} s after the out-of-memory error")


@pytest.mark.usefixtures("smi")
def test_a_sigkilled_rank_holding_10_gib_frees_it(tmp_path: Path) -> None:
    baseline = used_mib()
    hold = min(10 * 1024, total_mib() // 2) * MIB
    ready = tmp_path / "ready"
    run = parallel(nprocs=1, start_method="fork", timeout=120)(gpu_workers.hold_and_wait)
    future = run.submit(hold, str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists() and not future.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), future.exception() if future.done() else "the rank did not allocate within 60 s"
    assert used_mib() >= baseline + hold // MIB * 0.9  # the rank holds it
    os.kill(int(ready.read_text()), signal.SIGKILL)
    with pytest.raises(WorkerExitedError) as caught:
        future.result(timeout=60)
    assert caught.value.signal_name == "SIGKILL"
    print(f"GPU memory back {seconds_until_freed(baseline):.1f} s after the SIGKILL")


def test_a_timeout_in_synchronize_ends_with_every_ranks_stacks() -> None:
    run = parallel(nprocs=2, start_method="fork", timeout=20, grace_period=2.0)(gpu_workers.stuck_in_synchronize)
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        run()
    assert time.monotonic() - start < 20 + 1 + 2 + 5  # the timeout, the dump's bound, the grace, slack
    assert set(caught.value.stacks) == {0, 1}
    assert all("synchronize" in stack for stack in caught.value.stacks.values())


@pytest.mark.usefixtures("smi")
def test_five_launches_allocating_1_gib_stay_as_fast_as_the_first() -> None:
    baseline = used_mib()
    run = parallel(nprocs=1, start_method="fork", timeout=120)(gpu_workers.allocate)
    took = []
    for _ in range(5):
        start = time.monotonic()
        assert run(1 << 30) == 1 << 30
        took.append(time.monotonic() - start)
    print("launch times (s):", ", ".join(f"{t:.2f}" for t in took))
    assert max(took[1:]) <= 1.5 * took[0] + 1.0
    seconds_until_freed(baseline)
