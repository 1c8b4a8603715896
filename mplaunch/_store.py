"""The rendezvous store a single-node launch hosts for its workers (``MASTER_ADDR``/``MASTER_PORT``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch

from mplaunch._env import DEFAULT_MASTER_ADDR, OWN_PORT_VARIABLE
from mplaunch._errors import LaunchRefusedError


@contextlib.contextmanager
def rendezvous() -> Iterator[tuple[str, int, bool]]:
    """Yield ``(MASTER_ADDR, MASTER_PORT, agent_store)``.

    Unless the user set ``MASTER_PORT``, the parent hosts the c10d TCPStore itself on a port the OS assigns
    (port 0) and holds it for the whole launch, as torchrun's agent does: no "free port" is picked and
    released, so concurrent launches cannot collide.
    """
    own_port = os.environ.get(OWN_PORT_VARIABLE)
    port = os.environ.get("MASTER_PORT")
    if port and port == own_port:  # inherited from the launch this process is a worker of: not the user's
        port = None
    addr = (os.environ.get("MASTER_ADDR") if own_port is None else None) or DEFAULT_MASTER_ADDR
    if port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchRefusedError(f"MASTER_PORT={port!r} is not a TCP port: set it to 1-65535, or unset it.")
        yield addr, int(port), False
        return
    if not torch.distributed.is_available():
        import socket

        with socket.socket() as sock:
            sock.bind((addr, 0))
            free_port = sock.getsockname()[1]
        yield addr, free_port, False
        return
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except RuntimeError as error:  # DistNetworkError and friends
        raise LaunchRefusedError(
            f"cannot host the rendezvous store for MASTER_ADDR={addr!r}: {error}. Set MASTER_ADDR to an address "
            "of this machine (127.0.0.1 by default), or unset it."
        ) from error
    try:
        yield addr, store.port, True
    finally:
        del store
