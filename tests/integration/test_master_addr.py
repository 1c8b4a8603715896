"""A host-name ``MASTER_ADDR`` that does not resolve is refused within the launch's ``timeout`` (issue 21,
item 7)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mplaunch import LaunchRefusedError, parallel
from mplaunch._parent import store
from tests import compat_workers


@pytest.mark.parametrize("how", ["call", "submit"])
def test_a_master_addr_that_does_not_resolve_is_refused_in_time(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    fn = parallel(nprocs=1, start_method="fork", timeout=5)(compat_workers.pid)
    started = time.monotonic()
    with pytest.raises(LaunchRefusedError, match="MASTER_ADDR='no-such-host.invalid' does not resolve"):
        fn() if how == "call" else fn.submit().result(timeout=30)
    assert time.monotonic() - started < 6


def test_a_slow_resolver_is_waited_for_only_as_long_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def stuck(*args: object, **kwargs: object) -> object:
        release.wait(10)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    started = time.monotonic()
    try:
        with pytest.raises(LaunchRefusedError, match=r"MASTER_ADDR='slow.example' did not resolve within 0.2 s"):
            store._resolve("slow.example", 0.2)
    finally:
        release.set()
    assert time.monotonic() - started < 2


def test_a_name_that_resolves_is_hosted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert parallel(nprocs=1, start_method="fork", timeout=60)(compat_workers.pid)() > 0
