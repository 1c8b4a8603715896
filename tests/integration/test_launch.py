"""Real launches: return values, environment, arguments, on each start method where it matters."""

from __future__ import annotations

import os
import time

import pytest
import torch

from mplaunch import StartMethod, parallel
from tests import workers
from tests.helpers import free_port

ALL_METHODS = ["fork", "forkserver", "spawn"]
TIMEOUT = 90  # only a deadlock reaches it


@pytest.mark.parametrize("start_method", ALL_METHODS)
def test_returns_rank0_value_with_kwargs_and_env_contract(
    start_method: StartMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "5")  # stale values in the parent never reach a worker
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.setenv("GROUP_RANK", "3")  # (TORCHELASTIC_RUN_ID would mean "already under torchrun": in-process)
    before = dict(os.environ)
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)(workers.rank_and_env)
    results = run()
    assert dict(os.environ) == before  # nothing added, changed or removed in the parent
    assert [r["info"].rank for r in results] == [0, 1]
    for rank, result in enumerate(results):
        env = result["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == "1"
        assert result["threads"] == 1  # 2 cores // 2 workers
    assert len({results[0]["pid"], results[1]["pid"], os.getpid()}) == 3  # two workers, neither the parent
    assert results[0]["env"]["MASTER_PORT"] == results[1]["env"]["MASTER_PORT"]  # one store for the launch


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_gloo_process_group_works_with_env_init(start_method: StartMethod) -> None:
    run = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT)(workers.all_reduce_rank)
    assert run().item() == 3.0  # 1 + 2


def test_the_store_starts_when_a_worker_first_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent holds the port from the start, but starts the c10d store only for a launch whose workers
    connect to it: a bare store client and a process group are served; a launch that never connects starts
    no store (no threads, no start-up, no reverse lookup of the store's address)."""
    from mplaunch._parent import store

    started: list[int] = []
    host = store._host

    def counted(addr: str, port: int, fd: int | None) -> object:
        started.append(port)
        return host(addr, port, fd)

    monkeypatch.setattr(store, "_host", counted)
    quiet = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.rank_and_env)()
    assert int(quiet["env"]["MASTER_PORT"]) > 0
    assert started == []
    clients = parallel(nprocs=2, start_method="fork", return_all=True, timeout=TIMEOUT)(workers.plain_store_client)()
    assert clients[0] == clients[1]
    assert len(set(clients[0])) == 2
    assert len(started) == 1
    assert parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.all_reduce_rank)().item() == 3.0
    assert len(started) == 2


@pytest.mark.parametrize("addr", ["localhost", "::1"])
def test_the_users_master_addr_hosts_the_store(addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name (resolved by torch: the store starts at once) or an IPv6 address (listened on here)."""
    import socket

    if addr == "::1":
        try:
            socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
    monkeypatch.setenv("MASTER_ADDR", addr)
    result = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.rank_and_env)()
    assert result["env"]["MASTER_ADDR"] == addr
    assert parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.all_reduce_rank)().item() == 3.0


def test_an_address_not_of_this_machine_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch and debug() alike (debug() waited ~100 s in torch before failing: adversarial finding)."""
    from mplaunch import LaunchRefusedError

    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: documentation only, never a host's address
    run = parallel(nprocs=2, start_method="fork", backend="gloo", timeout=TIMEOUT)(workers.rank_and_env)
    for call in (run, run.debug):
        start = time.monotonic()
        with pytest.raises(LaunchRefusedError, match="MASTER_ADDR='192.0.2.1'"):
            call()
        assert time.monotonic() - start < 30


def test_user_master_addr_and_port_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    result = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.rank_and_env)()
    assert result["env"]["MASTER_ADDR"] == "localhost"
    assert result["env"]["MASTER_PORT"] == str(port)
    assert parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.all_reduce_rank)().item() == 3.0


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_arguments_and_nested_results(start_method: StartMethod) -> None:
    run = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT)(workers.nested_result)
    result = run()
    assert torch.equal(result["list"][0], torch.arange(10.0))
    assert result["list"][1].untyped_storage().data_ptr() == result["list"][0].untyped_storage().data_ptr()
    assert result["tuple"][0].dtype == torch.bfloat16
    assert result["tuple"][1] == 3
    assert isinstance(result["point"], workers.Point)
    assert result["point"].label == "p"
    assert isinstance(result["module"], torch.nn.Linear)
    assert result["module"].weight.device.type == "cpu"
    assert set(result["state"]) == {"weight", "bias"}
    assert result["ints"] == list(range(100_000))
    echo = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT)(workers.identity)
    args, kwargs = echo(1, torch.ones(3), key={"nested": [2]})
    assert args[0] == 1
    assert torch.equal(args[1], torch.ones(3))
    assert kwargs == {"key": {"nested": [2]}}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_large_result_is_complete_and_outlives_the_workers(start_method: StartMethod) -> None:
    run = parallel(nprocs=2, start_method=start_method, timeout=TIMEOUT)(workers.big_result)
    result = run(64)  # 64 MiB: far past a pipe buffer
    tensor = result["tensor"]
    assert tensor.numel() == 64 * 2**20 // 4
    assert tensor[-1].item() == tensor.numel() - 1
    assert result["meta"] == "ok"
    tensor.add_(1)  # the workers are gone; the memory is the parent's now
    assert tensor[0].item() == 1.0


def test_return_all_orders_by_rank() -> None:
    run = parallel(nprocs=2, start_method="fork", return_all=True, timeout=TIMEOUT)(workers.sleep)
    assert run(0.0) == [0, 1]


def test_decorated_function_still_runs_in_process() -> None:
    run = parallel(nprocs=2, start_method="fork")(workers.sleep)
    assert run.__wrapped__(0.0) == 0


def test_forkserver_workers_see_the_parents_current_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    run = parallel(nprocs=1, start_method="forkserver", timeout=TIMEOUT)(workers.read_env)
    run("HOME")  # the fork server is running from here on, with the environment it started with
    monkeypatch.setenv("MPLAUNCH_TEST_SETTING", "set after the fork server started")
    assert run("MPLAUNCH_TEST_SETTING") == "set after the fork server started"


@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_backend_option_initialises_the_process_group(backend: str) -> None:
    run = parallel(nprocs=2, start_method="fork", backend=backend, return_all=True, timeout=TIMEOUT)
    assert run(workers.all_reduce_in_given_group)() == [(2, 3.0), (2, 3.0)]


def test_backend_option_with_a_raising_function_still_fails_cleanly() -> None:
    run = parallel(nprocs=2, start_method="fork", backend="gloo", timeout=TIMEOUT)(workers.raise_value_error)
    with pytest.raises(ValueError, match="bad value"):
        run()


def test_newer_dtypes_travel() -> None:
    result = parallel(nprocs=2, start_method="fork", timeout=TIMEOUT)(workers.newer_dtypes)()
    assert result["uint16"].dtype == torch.uint16
    assert result["uint16"].to(torch.int32)[-1].item() == 59_999
    assert result["f8"].dtype == torch.float8_e4m3fn
    assert result["f8"].float().sum().item() == 8.0


def test_a_worker_can_launch_its_own_workers() -> None:
    """The inner launch must host its own store, not reuse the outer launch's MASTER_PORT."""
    assert parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.nested_launch)() == [(2, 3.0), (2, 3.0)]


def test_a_thread_left_running_does_not_hold_the_call() -> None:
    start = time.monotonic()
    assert parallel(nprocs=2, start_method="fork", return_all=True, timeout=60)(workers.leave_a_thread_running)() == [
        0,
        1,
    ]
    assert time.monotonic() - start < 30


def test_a_bound_decorated_method_passes_its_instance_to_every_entry() -> None:
    """obj.method.submit(), .debug() and .options(...)() dropped the instance: the first argument was taken
    as self (found by a break-it pass)."""
    import pickle

    trainer = workers.Trainer(10)
    assert trainer.fit(1) == 11  # spawn: the instance travels with the call
    assert trainer.fit.options(start_method="fork").submit(2).result(timeout=TIMEOUT) == 12
    assert trainer.fit.debug(3) == 13
    assert trainer.fit.config.timeout == 120  # the decorated function's attributes
    copy = pickle.loads(pickle.dumps(trainer.fit))
    assert copy.__self__.offset == 10
    assert copy(4) == 14


def test_methods_partials_and_a_parameter_named_self() -> None:
    import functools

    class Holder:
        times = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.Model.times)

    holder = Holder()
    holder.scale = 3  # type: ignore[attr-defined]
    assert holder.times(2) == 6  # bound like a method
    partial = parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(functools.partial(workers.identity, 1))
    assert partial(2) == ((1, 2), {})
    assert parallel(nprocs=1, start_method="fork", timeout=TIMEOUT)(workers.identity)(self=1) == ((), {"self": 1})
