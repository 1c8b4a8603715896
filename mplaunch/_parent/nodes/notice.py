"""Preemption of a multi-node launch: one node's notice reaches every node's ranks through the rendezvous store
(:func:`notices_exchanged`); after its own grace each node raises :class:`Preempted` out of elastic's agent, and
:func:`leave_barrier` checks it in at elastic's exit barrier, where the others would wait up to 300 s."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mplaunch._parent.preemption import Preemption

#: Elastic's exit barrier (``torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID``).
EXIT_BARRIER = "torchelastic/agent/terminal_state"
LOOK_INTERVAL = 0.1  # seconds between two looks for another node's notice


class Preempted(Exception):
    """Raised out of elastic's agent (which expects an ``Exception``) when this node's grace is over."""


def check_grace(preemption: Preemption | None) -> None:
    """Raise :class:`Preempted` once this node's grace is over."""
    if preemption is not None and preemption.noticed and preemption.remaining() == 0.0:
        raise Preempted()


@contextlib.contextmanager
def notices_exchanged(
    preemption: Preemption, endpoint: str, run_id: str, node_rank: Callable[[], int]
) -> Iterator[None]:
    """While the launch runs, exchange notices through the store at ``endpoint`` once the nodes met (node_rank()>=0)."""
    stop = threading.Event()
    key = f"mplaunch/{run_id}/preempted"

    def run() -> None:
        store = None
        with contextlib.suppress(Exception):  # a store gone: the node watch reports it
            while not stop.is_set():
                wait([preemption.fileno()], timeout=LOOK_INTERVAL)
                preemption.drain()
                rank = node_rank()
                if rank < 0:
                    continue
                if store is None:
                    store = _connect(endpoint)
                if preemption.noticed and preemption.origin is None:
                    signum = preemption.signum
                    store.set(key, f"{rank}:{'' if signum is None else signum}")
                    return  # told: the other nodes look for it
                if not preemption.noticed and store.check([key]):
                    origin, _, signum = store.get(key).decode().partition(":")
                    preemption.notify(int(signum) if signum else None, origin=int(origin))
                    return

    thread = threading.Thread(target=run, name="mplaunch-preemption", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _connect(endpoint: str) -> Any:
    """Connect this thread's own client of the rendezvous store at ``endpoint``."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host, _, port = endpoint.rpartition(":")  # (node_setup gives every endpoint its port)
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def leave_barrier(store: Any, nnodes: int) -> None:
    """Check this node in at elastic's exit barrier without waiting there, so the other agents need not wait."""
    with contextlib.suppress(Exception):  # a store gone: nobody waits on it
        if store.add(f"{EXIT_BARRIER}/num_members", 1) == nnodes:
            store.set(f"{EXIT_BARRIER}/last_member", "<val_ignored>")
