"""The rendezvous store a single-node launch hosts for its workers (``MASTER_ADDR``/``MASTER_PORT``). The
parent holds a port the OS assigns for the whole launch, as torchrun's agent does, so launches cannot collide,
and starts the c10d ``TCPStore`` on it only when a worker connects: no process group, no store."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from mplaunch._env import DEFAULT_MASTER_ADDR, OWN_PORT_VARIABLE, whole_number
from mplaunch._errors import LaunchRefusedError

#: How long the hosted store waits for a client's request.
STORE_TIMEOUT = timedelta(seconds=60)


class Rendezvous:
    """Where a launch's workers meet; with ``agent_store``, the store hosted here (started by :meth:`serve`)."""

    def __init__(
        self, addr: str, port: int, agent_store: bool, listener: socket.socket | None = None, store: Any = None
    ) -> None:
        self.addr = addr
        self.port = port
        self.agent_store = agent_store
        self._listener = listener
        self._store = store

    def fileno(self) -> int | None:
        """Return the listening socket to watch for a first connection, or ``None``."""
        return None if self._listener is None else self._listener.fileno()

    def serve(self) -> None:
        """Start the c10d ``TCPStore`` on the listening socket, once."""
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        self._store = _host(self.addr, self.port, listener.detach())

    def close(self) -> None:
        """Stop the store and close the socket."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None


@contextlib.contextmanager
def rendezvous(*, lazy: bool = True, resolve_within: float | None = None) -> Iterator[Rendezvous]:
    """Yield a :class:`Rendezvous`: the user's ``MASTER_PORT`` if set (as under ``mp.spawn``), else a store here."""
    own_port = os.environ.get(OWN_PORT_VARIABLE)
    port = os.environ.get("MASTER_PORT")
    if port and port == own_port:  # inherited from the launch this process is a worker of: not the user's
        port = None
    addr = (os.environ.get("MASTER_ADDR") if own_port is None else None) or DEFAULT_MASTER_ADDR
    if port:
        number = whole_number(port)
        if number is None or not 0 < number < 65536:
            raise LaunchRefusedError(f"MASTER_PORT={port!r} is not a TCP port: set it to 1-65535, or unset it.")
        yield Rendezvous(addr, number, agent_store=False)
        return
    if not torch.distributed.is_available():
        with socket.socket() as sock:
            sock.bind((addr, 0))
            free_port = sock.getsockname()[1]
        yield Rendezvous(addr, free_port, agent_store=False)
        return
    listener = _listen(addr)  # an address of this machine or not: told at once
    if listener is None:
        _resolve(addr, resolve_within)  # torch would wait minutes for a name that does not resolve
        store = _host(addr, 0, None)
        hosted = Rendezvous(addr, store.port, agent_store=True, store=store)
    else:
        hosted = Rendezvous(addr, listener.getsockname()[1], agent_store=True, listener=listener)
    try:
        if not lazy:
            hosted.serve()
        yield hosted
    finally:
        hosted.close()


def _listen(addr: str) -> socket.socket | None:
    """Return a socket listening on IP address ``addr`` at a port the OS assigns; ``None`` for a host name."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    except ValueError:
        return None
    try:
        return socket.create_server((addr, 0), family=family, backlog=socket.SOMAXCONN)
    except OSError as error:
        raise _refused(addr, error) from error


def _resolve(addr: str, within: float | None) -> None:
    """Refuse a host name ``addr`` that does not resolve within ``within`` seconds (looked up in a daemon thread)."""
    found: list[BaseException | None] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
            found.append(None)
        except OSError as error:
            found.append(error)

    thread = threading.Thread(target=look_up, name="mplaunch-resolve", daemon=True)
    thread.start()
    thread.join(within)
    if found and found[0] is None:
        return
    why = f"does not resolve ({found[0]})" if found else f"did not resolve within {within:g} s (the launch's timeout)"
    raise LaunchRefusedError(
        f"MASTER_ADDR={addr!r} {why}, so no rendezvous store can be hosted there. Set MASTER_ADDR to an address "
        "or host name of this machine (127.0.0.1 by default), or unset it."
    )


def _host(addr: str, port: int, fd: int | None) -> Any:
    """Start the c10d ``TCPStore`` server at ``addr:port``, on listening socket ``fd`` when given."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        return TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT, master_listen_fd=fd)
    except RuntimeError as error:  # DistNetworkError and friends (the socket, if given, is the store's now)
        raise _refused(addr, error) from error


def _refused(addr: str, error: Exception) -> LaunchRefusedError:
    return LaunchRefusedError(
        f"cannot host the rendezvous store for MASTER_ADDR={addr!r}: {error}. Set MASTER_ADDR to an address "
        "of this machine (127.0.0.1 by default), or unset it."
    )
