"""Fixtures that fail a test which leaves processes, environment variables, signal handlers or shared-memory
files behind (the loky/CPython approach to testing process code without leaks)."""

from __future__ import annotations

import functools
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence

import psutil
import pytest
import torch

from mplaunch._parent import directory
from tests import hosts as network_hosts

# One intra-op thread per worker and in the test process: 2 cores, tests run fast and never oversubscribe.
torch.set_num_threads(1)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _helper_pids() -> set[int]:
    """Long-lived helpers kept on purpose: multiprocessing's fork server and resource tracker, and mplaunch's
    reaper of launch directories."""
    pids = set(directory.reaper_pids())
    for pid in (
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    ):
        if pid:
            pids.add(pid)
    return pids


def _children() -> list[psutil.Process]:
    helpers = _helper_pids()
    found = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in helpers:
            continue
        try:
            if child.ppid() in helpers:  # the fork server's own bookkeeping is covered by its workers' checks
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
        except psutil.NoSuchProcess:
            continue
        found.append(child)
    return found


def _shm_entries() -> set[str]:
    """This process's launch directories (other processes on the machine may be launching too)."""
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{os.getpid()}-")}
    except FileNotFoundError:
        return set()


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(autouse=True)
def no_leaks() -> object:
    env_before = _environment()
    handlers_before = {s: signal.getsignal(s) for s in _SIGNALS}
    shm_before = _shm_entries()
    yield
    deadline = time.monotonic() + 10
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = _children()
    for child in leftover:
        child.kill()
    assert not leftover, f"processes left behind: {[(c.pid, c.name()) for c in leftover]}"
    assert _environment() == env_before, "the environment changed"
    assert {s: signal.getsignal(s) for s in _SIGNALS} == handlers_before, "signal handlers changed"
    left = {e: sorted(os.listdir(f"/dev/shm/{e}")) for e in _shm_entries() - shm_before}
    assert not left, f"shared-memory files left: {left}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a CUDA device; without one they are skipped (CI has none). ``device_count()``
    asks NVML: ``is_available()`` would initialise the driver here, and refuse every later ``fork`` launch. On
    a CUDA build without NVML it still marks this process's fork children "bad", as a user's probe would."""
    if torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@functools.cache
def _hosts_unavailable() -> str | None:
    return network_hosts.unavailable()


@pytest.fixture
def hosts() -> Iterator[Callable[..., list[network_hosts.Host]]]:
    """A maker of hosts for the test (``hosts(["host1", "host2"], own_name_on_loopback=True)``): network
    namespaces on this machine with their own addresses, names and hosts files (``tests/hosts.py``), removed at the
    end of the test whatever happens. The test is skipped, with the reason, where they cannot be made."""
    reason = _hosts_unavailable()
    if reason is not None:
        pytest.skip(reason)
    made: list[list[network_hosts.Host]] = []

    def make(names: Sequence[str], **options: bool) -> list[network_hosts.Host]:
        made.append(network_hosts.make_hosts(f"t{len(made)}", names, **options))
        return made[-1]

    try:
        yield make
    finally:
        for group in made:
            network_hosts.remove(group)


def pytest_sessionstart(session: pytest.Session) -> None:
    network_hosts.remove_stale()  # what a session killed before its end left


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    network_hosts.remove_all()  # what a test of this process left, if its own cleanup could not run
