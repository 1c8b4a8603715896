"""Every start method starts workers from the parent's state, and keeps the parent's objects private."""

from __future__ import annotations

import random
from typing import Any

import numpy
import pytest
import torch

from mplaunch import StartMethod, parallel
from tests import workers

TIMEOUT = 90


def parent_draws() -> dict[str, Any]:
    """What the parent itself would draw next, computed without disturbing its state."""
    from mplaunch import GlobalState

    state = GlobalState.capture()
    try:
        return workers.random_draws()
    finally:
        state.restore()


def _next_three() -> list[float]:
    """The parent's next Python, NumPy and torch numbers, drawn without changing its state."""
    from mplaunch import GlobalState

    state = GlobalState.capture()
    try:
        return [random.random(), float(numpy.random.rand()), torch.rand(1).item()]
    finally:
        state.restore()


@pytest.fixture
def seeded_parent() -> object:
    from mplaunch import GlobalState

    before = GlobalState.capture()
    random.seed(1234)
    numpy.random.seed(1234)
    torch.manual_seed(1234)
    torch.set_float32_matmul_precision("medium")
    yield
    before.restore()


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_workers_draw_exactly_what_the_parent_would(seeded_parent: None, start_method: StartMethod) -> None:
    expected = parent_draws()
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)(workers.random_draws)
    for result in run():
        assert result["python"] == expected["python"]
        assert numpy.array_equal(result["numpy"], expected["numpy"])
        assert torch.equal(result["torch"], expected["torch"])
        assert torch.equal(result["weight"], expected["weight"])
        assert result["matmul"] == "medium"
        assert result["dtype"] == torch.float32
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_calls_in_a_row_draw_anew_unless_the_parent_seeds_again(seeded_parent: None, start_method: StartMethod) -> None:
    """Issue 37: every call restored the parent's captured random state, so two calls in a row drew the same
    numbers (DataLoader workers' seeds with them). A call from the state the previous call started from now
    draws anew; the ranks of one call still draw alike; seeding again, to the same seed, starts over; and the
    parent itself draws what it would have."""
    expected = _next_three()
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)
    draws = run(workers.draws_and_loader_draws)
    first, second = draws(), draws()
    assert first[0] == first[1] and second[0] == second[1]  # the ranks start alike
    assert not set(first[0]) & set(second[0])  # the second call repeats none of the first's numbers
    assert first[0][:3] == expected
    assert _next_three() == expected  # the parent's own next numbers are unchanged
    if start_method == "fork":  # (the parent decides it: one start method is enough, the fastest)
        random.seed(1234)
        numpy.random.seed(1234)
        torch.manual_seed(1234)
        assert draws() == first  # seeded again: the first call's numbers


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_seed_gives_each_rank_its_own_numbers_the_same_at_every_call(
    seeded_parent: None, start_method: StartMethod
) -> None:
    """seed=: each rank seeds Python, NumPy and torch with (seed, rank); its DataLoader workers differ per rank."""
    from mplaunch._state.snapshot import derived_seed

    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT, seed=7)
    first = run(workers.draws_and_loader_draws)()
    random.random(), torch.rand(1)  # the parent draws meanwhile: it does not matter
    if start_method == "fork":  # (the numbers are (seed, rank)'s, checked below: one start method is enough)
        assert run(workers.draws_and_loader_draws)() == first
    assert not set(first[0]) & set(first[1])  # the ranks differ, and so do their DataLoader workers
    for rank in (0, 1):
        own = derived_seed(7, rank)
        assert first[rank][0] == random.Random(own).random()
        assert first[rank][2] == torch.rand(1, generator=torch.Generator().manual_seed(own)).item()
    other = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT, seed=8)(workers.draws_and_loader_draws)
    assert other() != first[0]


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_arguments_are_private_to_each_worker(start_method: StartMethod) -> None:
    """Arguments the user did not share are private to each worker; what share_memory() shared stays
    shared (tests/integration/test_hogwild.py)."""
    module = torch.nn.Linear(256, 256, bias=False)
    torch.nn.init.zeros_(module.weight)
    tensor = torch.zeros(1 << 16)
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)(workers.mutate)
    results = run(module, tensor)
    size = module.weight.numel()
    assert results == [
        {"weight": 1.0 * size, "tensor": 1.0 * tensor.numel()},
        {"weight": 2.0 * size, "tensor": 2.0 * tensor.numel()},
    ]
    assert module.weight.sum().item() == 0
    assert tensor.sum().item() == 0  # the parent's objects are untouched


@pytest.mark.parametrize("padding", [0, 20_000], ids=["small", "large"])
def test_a_results_tensors_and_arrays_are_private_arguments_under_fork(padding: int) -> None:
    """A result comes back mapped from shared memory (one copy, no file descriptor): passed to a fork launch,
    its tensors, modules and NumPy arrays are private to each worker like any argument. They were shared by
    the forked workers and the parent (an in-place add in a worker changed the caller's tensor). With a
    large argument the workers walk it because this process maps shared memory."""
    items = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.zeros_result)()
    items["padding"] = list(range(padding))
    run = parallel(nprocs=2, start_method="fork", return_all=True, timeout=TIMEOUT)(workers.mutate_items)
    results = run(items)
    weights, values = items["module"].weight.numel(), items["tensor"].numel()
    for rank, result in enumerate(results):
        assert result == {
            "tensor": (rank + 1.0) * values,
            "array": (rank + 1.0) * values,
            "weight": (rank + 1.0) * weights,
        }
    assert items["tensor"].sum().item() == items["array"].sum() == items["module"].weight.sum().item() == 0


def test_parent_thread_settings_are_untouched() -> None:
    before = torch.get_num_threads()
    parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.rank_and_env)()
    assert torch.get_num_threads() == before


def test_worker_threads_default_to_cores_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch._platform.cpus import usable_cpu_count

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = parallel(nprocs=1, start_method="forkserver", timeout=TIMEOUT)(workers.rank_and_env)()
    assert result["threads"] == usable_cpu_count()
    assert result["env"]["OMP_NUM_THREADS"] == str(usable_cpu_count())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = parallel(nprocs=1, start_method="forkserver", timeout=TIMEOUT)(workers.rank_and_env)()
    assert result["threads"] == 1
    assert result["env"]["OMP_NUM_THREADS"] == "1"


def test_a_forked_ranks_omp_num_threads_is_the_count_it_runs() -> None:
    """env= may give OMP_NUM_THREADS as no count torch takes (OpenMP's "4,2"): the rank runs the launch's
    count and says so, under fork as under spawn. A forked rank whose environment the parent made wrote
    env='s "4,2" back over it (the parent had set the count)."""
    seen = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT, env={"OMP_NUM_THREADS": "4,2"}, return_all=True)
    for result in seen(workers.rank_and_env)():
        assert result["env"]["OMP_NUM_THREADS"] == str(result["threads"]), result


def test_warm_ranks_started_inside_a_forked_rank_get_their_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process forked from a rank whose environment the parent made took that for its own: warm workers it
    started never set OMP_NUM_THREADS."""
    monkeypatch.setenv("MPLAUNCH_IN_PROCESS", "0")  # (the nested launch starts workers)
    found = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.threads_of_nested_warm_ranks)()
    assert [omp for omp, _ in found] == [str(threads) for _, threads in found], found


@pytest.mark.parametrize("start_method", ["forkserver"])
def test_spawned_arguments_are_mapped_not_copied(start_method: StartMethod) -> None:
    anonymous = parallel(nprocs=1, start_method=start_method, timeout=TIMEOUT)(workers.anonymous_memory_after_reading)
    baseline = anonymous(torch.ones(1024))
    # read through a private mapping of the parent's copy: no private 128 MiB copy was made
    assert anonymous(torch.ones(128 * 2**20 // 4)) - baseline < 32 * 2**20


def test_seed_applies_to_a_call_that_runs_in_process_as_its_rank(
    seeded_parent: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under an outer launcher (torchrun) the function runs in this process, which is the rank: seed= seeds it
    with (seed, RANK) as a launched rank would be; so does fn.debug() as rank 0."""
    from mplaunch._state.snapshot import derived_seed

    draw = parallel(nprocs=2, seed=7)(workers.draws_and_loader_draws)
    assert draw.debug()[0] == random.Random(derived_seed(7, 0)).random()
    monkeypatch.setenv("MPLAUNCH_IN_PROCESS", "1")
    monkeypatch.setenv("RANK", "1")
    assert draw()[0] == random.Random(derived_seed(7, 1)).random()
