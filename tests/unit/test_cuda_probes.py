"""No launch path initialises CUDA's driver in the parent, and the start method after a user's probe is one
whose workers can use CUDA. On the CPU: a CUDA build with two GPUs whose NVML answers is simulated, and every
entry that would run ``cuInit`` in this process fails loudly."""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import mplaunch
from mplaunch import LaunchRefusedError, parallel
from mplaunch._parent import checks, devices, policy, ranks
from mplaunch._platform import cuda
from tests import workers

_REAL_CDLL = ctypes.CDLL
_IS_AVAILABLE = torch.cuda.is_available


class _Reached(Exception):
    """Raised where the workers would start: the parent's side of the launch is done."""


def _loud(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the parent called {name}, which initialises the CUDA driver")

    return call


class _Driver:
    """A loaded libcuda whose driver is not initialised: ``cuInit`` fails loudly."""

    cuInit = staticmethod(_loud("cuInit"))
    cuDeviceGetCount = staticmethod(lambda count: 3)  # CUDA_ERROR_NOT_INITIALIZED


def _cdll(name: str, *args: Any, **kwargs: Any) -> Any:
    return _Driver() if name == "libcuda.so.1" else _REAL_CDLL(name, *args, **kwargs)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A CUDA build with two GPUs (NVML answers) and no driver initialised; returns the worker specs of each start
    (which ends the launch with ``_Reached``)."""
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _loud("torch._C._cuda_getDeviceCount"), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_init", _loud("torch._C._cuda_init"), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", _loud("torch.cuda.is_available()"))
    monkeypatch.setattr(torch.cuda, "_lazy_init", _loud("torch.cuda._lazy_init"))
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(cuda, "driver_device_count", _loud("a count through the driver"))
    monkeypatch.setattr(ctypes, "CDLL", _cdll)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    started: list[Any] = []

    def start_workers(specs: Any, *args: Any, **kwargs: Any) -> None:
        started.append(specs)
        raise _Reached

    monkeypatch.setattr(ranks, "start_workers", start_workers)
    return started


def _plain() -> int:
    return 1


def _stream() -> Iterator[int]:
    yield 1


def test_the_simulation_is_a_cuda_build_whose_probes_would_initialise(two_gpus: list[Any]) -> None:
    assert torch.cuda.device_count() == 2  # torch's own count asks NVML
    with pytest.raises(AssertionError, match="_cuda_getDeviceCount"):
        _IS_AVAILABLE()  # the CUDA runtime's count
    with pytest.raises(AssertionError, match="_lazy_init"):
        torch.cuda.init()


_auto = parallel(nprocs="auto", backend="auto", timeout=60)
_WAYS: dict[str, Callable[[], Any]] = {
    "a call": lambda: _auto(_plain)(),
    "submit()": lambda: _auto(_plain).submit().result(timeout=60),
    "a generator function": lambda: next(iter(_auto(_stream)())),
    "devices= and numa binding": lambda: parallel(devices=[1], cpu_binding="numa", backend="auto")(_plain)(),
    "a count of devices, spawn": lambda: parallel(nprocs=2, devices=1, start_method="spawn")(workers.identity)(),
    "Workers": lambda: mplaunch.Workers(nprocs="auto", backend="auto"),
    "mplaunch.spawn": lambda: mplaunch.spawn(workers.identity, nprocs=2, backend="auto", start_method="forkserver"),
}


@pytest.mark.parametrize("way", list(_WAYS))
def test_no_way_of_launching_initialises_cuda_in_the_parent(
    way: str, two_gpus: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy, "is_interactive", lambda: True)  # the default start method asks too
    with pytest.raises(_Reached):
        _WAYS[way]()
    launch = two_gpus[0][0].launch
    if way == "devices= and numa binding":
        assert launch.placements[0].cuda_visible_devices == "1"
    else:
        assert launch.nprocs == 2  # the devices, counted (or devices=1 with nprocs=2)
    assert launch.backend == (None if way == "a count of devices, spawn" else "nccl")  # a device per rank
    if "spawn" not in way:
        assert launch.start_method == "fork"  # nothing initialised: the interactive default stands


_fork = parallel(nprocs=1, start_method="fork", timeout=60)
_FORK_WAYS: dict[str, Callable[[], Any]] = {
    "a call": lambda: _fork(_plain)(),
    "submit()": lambda: _fork(_plain).submit().result(timeout=60),
    "a generator function": lambda: next(iter(_fork(_stream)())),
    "Workers": lambda: mplaunch.Workers(nprocs=1, start_method="fork"),
    "mplaunch.spawn": lambda: mplaunch.spawn(workers.identity, nprocs=1, start_method="fork"),
}


@pytest.mark.parametrize("way", list(_WAYS))
def test_every_way_after_a_probe_spawns_by_default_and_refuses_fork(
    way: str, two_gpus: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda, "driver_initialised", lambda: True)  # as after torch.cuda.is_available()
    monkeypatch.setattr(policy, "is_interactive", lambda: True)
    monkeypatch.setattr(policy, "_said_spawn", True)  # (said once: test_the_default_after_a_probe_is_spawn_said_once)
    with pytest.raises(_Reached):
        _WAYS[way]()
    if "spawn" not in way:
        assert two_gpus[0][0].launch.start_method == "spawn"
    if way in _FORK_WAYS:
        with pytest.raises(LaunchRefusedError, match="the CUDA driver is initialised in this process"):
            _FORK_WAYS[way]()


def test_fork_after_a_probe_is_refused_with_the_cause_and_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "driver_initialised", lambda: True)  # as after torch.cuda.is_available()
    with pytest.raises(LaunchRefusedError) as refused:
        checks.check_cuda_fork("fork")
    message = str(refused.value)
    assert "the CUDA driver is initialised in this process" in message
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in message
    assert "torch.cuda.device_count()" in message
    assert "start_method='spawn' or 'forkserver'" in message
    checks.check_cuda_fork("spawn")
    checks.check_cuda_fork("forkserver")


def test_the_default_after_a_probe_is_spawn_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "_said_spawn", False)
    monkeypatch.setattr(policy, "is_interactive", lambda: True)
    assert policy.default_start_method() == "fork"
    monkeypatch.setattr(cuda, "driver_initialised", lambda: True)
    with pytest.warns(RuntimeWarning, match="spawn here, not fork: the CUDA driver is initialised") as said:
        assert policy.default_start_method() == "spawn"
    assert len(said) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.default_start_method() == "spawn"  # said once
        monkeypatch.setattr(policy, "is_interactive", lambda: False)
        assert policy.default_start_method() == "spawn"  # a script's default: nothing to say


def test_a_forked_process_without_devices_may_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build's probe marks every later fork child "bad" (torch's flag), also where no driver or device
    exists: there nothing can use CUDA, and a launch from such a child (a nested launch, a pool worker) is not
    refused."""
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(devices, "device_count", lambda: 0)
    checks.check_cuda_fork("fork")
    monkeypatch.setattr(devices, "device_count", lambda: 1)
    with pytest.raises(LaunchRefusedError, match="forked from a process that had initialised CUDA"):
        checks.check_cuda_fork("fork")


def _probe_here() -> bool:
    return torch.cuda.is_available()


def test_a_refusal_names_the_probe_that_initialised_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    initialised: list[bool] = []

    def get_device_count() -> int:  # the CUDA runtime's count: cuInit, then the count
        initialised.append(True)
        return 1

    monkeypatch.setattr(checks, "_first_cuda_init", None)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", get_device_count, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", torch.cuda._lazy_init)
    monkeypatch.setattr(torch.cuda.random, "_lazy_init", torch.cuda._lazy_init)
    monkeypatch.setattr(cuda, "driver_initialised", lambda: bool(initialised))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    mplaunch.record_cuda_init()
    assert _probe_here()
    with pytest.raises(LaunchRefusedError) as refused:
        checks.check_cuda_fork("fork")
    assert "CUDA was first initialised here" in str(refused.value)
    assert "in _probe_here" in str(refused.value)


def test_the_driver_is_asked_without_initialising_it() -> None:
    """Here no driver is loaded: not initialised, and a throwaway process counts no device."""
    assert cuda.driver_initialised() is False
    cuda.driver_device_count.cache_clear()
    assert cuda.driver_device_count("0") == 0
