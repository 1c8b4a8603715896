"""The device pool with an injected device list, the names ranks see, and the placement options' checks."""

from __future__ import annotations

import threading

import pytest

from mplaunch import InvalidOptionError, parallel
from mplaunch._parent import devices
from mplaunch._parent.control import LaunchControl, LaunchStopped


@pytest.fixture
def two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_names_follow_the_parents_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "device_count", lambda: 3)
    assert devices.visible_names({}) == ["0", "1", "2"]
    assert devices.visible_names({"CUDA_VISIBLE_DEVICES": "4,5,6"})[1] == "5"
    assert devices.visible_names({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b,GPU-c"}) == ["GPU-a", "GPU-b", "GPU-c"]


@pytest.mark.usefixtures("two_devices")
def test_requests_that_can_never_be_granted_name_the_visible_devices() -> None:
    devices.check_request((0, 1))
    with pytest.raises(InvalidOptionError, match=r"devices=\[0, 5\].*\[5\].*0 \(0\), 1 \(1\)"):
        devices.check_request((0, 5))
    with pytest.raises(InvalidOptionError, match="devices=3.*sees \\(2"):
        devices.check_request(3)


def test_a_count_of_devices_without_any_says_there_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(InvalidOptionError, match="devices=1 asks for CUDA devices, and this process sees none"):
        devices.check_request(1)  # it said "Pass at most 0"


@pytest.mark.usefixtures("two_devices")
def test_pool_never_gives_a_device_twice_and_serves_waiters_when_released() -> None:
    pool = devices.DevicePool()
    first = pool.acquire(1)
    second = pool.acquire(1)
    assert {first, second} == {(0,), (1,)}
    assert pool.busy() == {0, 1}
    got: list[tuple[int, ...]] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire((1,))))
    waiter.start()
    pool.release(first)  # device 0 is free, but the waiter wants 1
    assert pool.acquire(1) == first  # a later request may take what the waiter cannot use
    assert not got
    pool.release(second)
    waiter.join(10)
    assert got == [(1,)]
    assert pool.busy() == {0, 1}


@pytest.mark.usefixtures("two_devices")
def test_a_stop_ends_the_wait() -> None:
    pool = devices.DevicePool()
    held = pool.acquire(2)
    control = LaunchControl()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(1, control)
        except LaunchStopped as error:
            errors.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    control.request_stop()
    waiter.join(10)
    assert errors
    assert pool.busy() == set(held)


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"devices": 0}, "devices=0"),
        ({"devices": [1, 1]}, r"devices=\[1, 1\]"),
        ({"devices": [-1]}, r"devices=\[-1\]"),
        ({"devices": []}, r"devices=\[\]"),
        ({"devices": "0"}, "devices='0'"),
        ({"devices": True}, "devices=True"),
        ({"cpu_binding": "sockets"}, "cpu_binding='sockets'.*'cores'"),
        ({"env": {"RANK": "3"}}, "env sets RANK"),
        ({"env": {"MASTER_PORT": "1"}}, "env sets MASTER_PORT"),
        ({"env": {"A": 1}}, "strings.*'A': 1"),
        ({"env": "A=1"}, "env='A=1'"),
        # names and values no environment holds: each worker failed with a bare ValueError or OSError
        ({"env": {"A=B": "1"}}, "no environment can hold 'A=B'"),
        ({"env": {"": "1"}}, "no environment can hold ''"),
        ({"env": {"A\0": "1"}}, r"no environment can hold 'A\\x00': '1'"),
        ({"env": {"A": "x\0y"}}, r"no environment can hold 'A': 'x\\x00y'"),
        # a lone surrogate: a bare UnicodeEncodeError from the parent's fork_environs (fork), a rank's (spawn)
        ({"env": {"A": "\ud800"}}, r"no environment can hold 'A': '\\ud800'.*encoding"),
        ({"env": {"\ud800": "1"}}, r"no environment can hold '\\ud800'"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "1"}, "devices": 1}, "devices= only"),
        ({"prefix_output": "{rank}|{host} "}, "Unknown field.*'host'"),
        ({"prefix_output": "{}"}, "prefix_output='{}'"),
    ],
)
def test_placement_options_are_refused_when_decorating(options: dict[str, object], text: str) -> None:
    with pytest.raises(InvalidOptionError, match=text):
        parallel(**options)  # type: ignore[call-overload]


def test_placement_options_are_kept_normalised() -> None:
    given = {"A": "1"}
    config = parallel(devices=[2, 3], cpu_binding="numa", env=given, prefix_output="{rank}|{pid} ")(len).config
    given["A"] = "2"
    assert config.devices == (2, 3)
    assert config.env == {"A": "1"}
    assert config.prefix_output == "{rank}|{pid} "
    assert parallel(env={"CUDA_VISIBLE_DEVICES": "1"})(len).config.env == {"CUDA_VISIBLE_DEVICES": "1"}


def test_plan_shares_a_numa_nodes_cores_between_its_ranks_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch._parent import placement
    from mplaunch._platform import topology

    monkeypatch.setattr(
        topology,
        "split_numa",
        lambda cpus, nprocs, preferred=(): [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7)), (0, (0, 1, 2, 3))],
    )
    config = parallel(cpu_binding="numa", env=lambda rank: {"PLACEMENT_R": str(rank)})(len).config
    plan = placement.plan(config, 3, ["4", "5"], multinode=False, threads_kept=True)
    assert plan is not None
    assert [(p.numa_node, p.num_threads) for p in plan] == [(0, 2), (1, 4), (0, 2)]  # never more threads than cores
    assert [p.environ for p in plan] == [{"PLACEMENT_R": "0"}, {"PLACEMENT_R": "1"}, {"PLACEMENT_R": "2"}]
    assert {p.cuda_visible_devices for p in plan} == {"4,5"}
    assert placement.plan(config, 3, None, multinode=False, threads_kept=False)[0].num_threads is None  # type: ignore[index]
