"""Watching the other nodes of a multi-node launch (elastic's agent notices neither a lost node nor a time limit):
:class:`WatchedRendezvous` wraps c10d's handler and raises out of the agent at its ``num_nodes_waiting`` (a node
dropped, a silent store, a closed rendezvous, ``timeout``); :meth:`NodeWatch.guarded` ends torch's blocked calls."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as _registry
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousInfo

from mplaunch._errors import LaunchTimeoutError, NodeLostError
from mplaunch._parent.nodes import notice
from mplaunch._platform.network import interface_towards, shut_connections
from mplaunch._wire import transport
from mplaunch._wire.records import NODE_ROUND

if TYPE_CHECKING:
    from mplaunch._parent.preemption import Preemption

BACKEND = "mplaunch-c10d"
WATCH_KEY = "mplaunch_watch"
KEEP_ALIVE_INTERVAL = 2  # seconds between two heartbeats of a node (c10d's default: 5)
KEEP_ALIVE_MAX_ATTEMPT = 5  # heartbeats a node may miss before it is dropped: lost after 10 s of silence
PROBE_WAIT = 2 * KEEP_ALIVE_INTERVAL + 1  # seconds a node that failed waits for a sign of life of the others
STORE_SILENCE = KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MAX_ATTEMPT  # seconds the store may be silent once the nodes met


@dataclasses.dataclass
class NodeWatch:
    """What one node's launch knows about its rendezvous, shared with (and filled by) its rendezvous handler."""

    endpoint: str  # host:port
    nnodes: int
    timeout: float | None  # seconds
    deadline: float | None = None  # time.monotonic() at which timeout expires
    joined: bool = False  # the nodes met at least once
    store_lost: BaseException | None = None  # the store's error, once it stopped answering
    peers: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)  # node rank: (host, pid)
    lost_peer: Callable[[], NodeLostError | None] | None = None
    preemption: Preemption | None = None  # the notice, when the ranks can be told
    node_rank: int = -1  # -1 before the nodes met
    leave_barrier: Callable[[], None] | None = None
    directory: str | None = None  # the launch directory: each round's variables go there (see :meth:`met`)
    max_restarts: int = 0  # rounds after the first: a node lost meanwhile may rejoin
    lost_node: NodeLostError | None = None  # the node lost in this round, once known
    on_restart: Callable[[], None] = lambda: None  # called as a later round begins
    holder: Any = None  # c10d's rendezvous state holder, once the nodes met

    def __post_init__(self) -> None:
        if self.timeout is not None and self.deadline is None:
            self.deadline = time.monotonic() + self.timeout

    def remaining(self) -> float | None:
        """Return the seconds left before ``timeout`` (at least 0.1), or ``None`` without one."""
        return None if self.deadline is None else max(0.1, self.deadline - time.monotonic())

    def check_deadline(self) -> None:
        """Raise :class:`LaunchTimeoutError` once ``timeout`` has expired."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise LaunchTimeoutError(
                f"the multi-node launch did not finish within timeout={self.timeout:g} s; this node's ranks were "
                "still running and have been stopped (stacks are not collected on a multi-node launch). Raise "
                "timeout, or look for a rank stuck in a collective.",
                float(self.timeout or 0.0),
                (),
            )

    def met(self, round: int) -> None:
        """Write the round's number and, unless set, the interface reaching the other nodes for the ranks' gloo/NCCL."""
        # gloo binds the host name's address by default (loopback on Debian), NCCL the first interface it finds
        towards = next(filter(None, (interface_towards(host) for _, (host, _) in sorted(self.peers.items()))), "")
        names = {"GLOO_SOCKET_IFNAME": towards, "NCCL_SOCKET_IFNAME": f"={towards}"}  # NCCL's "=": this name exactly
        variables = {name: value for name, value in names.items() if towards and name not in os.environ}
        if self.directory is not None:
            transport.dump({**variables, "TORCHELASTIC_RESTART_COUNT": str(round)}, self.directory, NODE_ROUND)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Shut this process's store connections at ``timeout`` or after ``STORE_SILENCE`` s of a silent store."""
        stop = threading.Event()
        guard = threading.Thread(target=self._guard, args=(stop,), name="mplaunch-store-guard", daemon=True)
        guard.start()
        try:
            yield
        finally:
            stop.set()
            guard.join()

    def _guard(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            now = time.monotonic()
            expired = self.deadline is not None and now >= self.deadline
            synced = getattr(self.holder, "_last_sync_time", now)  # c10d's last answer from the store (torch's private)
            if self.joined and now - synced > STORE_SILENCE and self.store_lost is None:
                self.store_lost = RendezvousError(f"it did not answer for {STORE_SILENCE} s")
            if expired or self.store_lost is not None:
                shut_connections(int(self.endpoint.rpartition(":")[2]))
                return

    def store_error(self, error: BaseException) -> NodeLostError:
        """Return the error for a rendezvous store that stopped answering after the nodes met."""
        self.store_lost = error
        node_rank, host, pid, which = None, self.endpoint.rsplit(":", 1)[0], None, "the node hosting it"
        hosting = [rank for rank, (addr, _) in self.peers.items() if addr == host or addr.startswith(f"{host}.")]
        if hosting or len(self.peers) == 1:  # the store is not this node's: it is the other node's
            node_rank = min(hosting or self.peers)
            host, pid = self.peers[node_rank]
            which = f"node {node_rank} of {self.nnodes} (host {host}, launching process pid {pid}), which hosts it,"
        return NodeLostError(
            f"the rendezvous store at {self.endpoint} stopped answering after the {self.nnodes} nodes met "
            f"({type(error).__name__}: {error}): {which} is gone or cut off. Its launching process was killed or "
            "stopped, its launch ended or the network to it is down (the store lives in the launching process of the "
            "first node started at that endpoint, and ends with it). This node's workers have been stopped.",
            node_rank,
            host,
            pid,
            self.endpoint,
        )


class WatchedRendezvous(RendezvousHandler):
    """Elastic's c10d rendezvous handler, plus the checks of :class:`NodeWatch` (see the module docstring)."""

    def __init__(self, handler: Any, watch: NodeWatch) -> None:
        self._handler = handler
        self._watch = watch
        self._round = -1
        self._participants: dict[Any, int] = {}  # c10d's node descriptions (addr, pid, local_id) -> node rank
        self._own = -1  # this node's rank in the round
        self._store: Any = None  # the round's store

    @property
    def use_agent_store(self) -> bool:
        return bool(self._handler.use_agent_store)

    def get_backend(self) -> str:
        return str(self._handler.get_backend())

    def get_run_id(self) -> str:
        return str(self._handler.get_run_id())

    def next_rendezvous(self) -> RendezvousInfo:
        preemption = self._watch.preemption
        if self._round >= 0 and preemption is not None and preemption.noticed:
            raise notice.Preempted()  # a preempted launch is never restarted
        if self._round >= 0:  # a later round: torch would keep round 0's MASTER_ADDR/PORT, which it publishes in
            self._handler._bootstrap_store_info = None  # round 0's store only (a rejoined node waits for them forever)
            self._watch.on_restart()
        info: RendezvousInfo = self._handler.next_rendezvous()
        state = self._state()
        if state is not None:
            self._round, self._participants = state.round, dict(state.participants)
            this_node = getattr(self._handler, "_this_node", None)
            self._own = self._participants.get(this_node, -1)
            self._watch.node_rank = self._own
            self._watch.peers = {
                rank: (node.addr, node.pid) for node, rank in self._participants.items() if node != this_node
            }
        self._store = info.store
        self._watch.met(max(self._round, 0))
        self._watch.holder, self._watch.joined = getattr(self._handler, "_state_holder", None), True
        self._watch.lost_peer = self.lost_peer
        self._watch.leave_barrier = self.leave_barrier
        return info

    def is_closed(self) -> bool:
        return bool(self._handler.is_closed())

    def set_closed(self) -> None:
        self._handler.set_closed()

    def shutdown(self) -> bool:
        if self._store is not None:
            with contextlib.suppress(Exception):  # a store that is gone: told by the close below
                self._store.set(f"mplaunch/ended/{self._own}", "1")
        closed = bool(self._handler.shutdown())
        if not closed and self._watch.joined and self._watch.store_lost is None:
            self._watch.store_lost = RendezvousError("it did not answer when this node closed the rendezvous")
        return closed

    def num_nodes_waiting(self) -> int:
        """Return elastic's count of waiting nodes; raise for a lost node, ``timeout`` or the end of the grace."""
        self._watch.check_deadline()
        notice.check_grace(self._watch.preemption)
        try:
            waiting = int(self._handler.num_nodes_waiting())
        except RendezvousError as error:
            raise self._watch.store_error(self._watch.store_lost or error) from error
        state = self._state()
        if state is None or state.round != self._round:
            return waiting  # a new round: elastic restarts the workers
        lost = sorted((rank, node) for node, rank in self._participants.items() if node not in state.participants)
        if lost:
            self._watch.lost_node = self._lost(*lost[0])
            if self._round >= self._watch.max_restarts:
                raise self._watch.lost_node
            return len(lost)  # elastic restarts this node's workers, and waits for the lost node to rejoin
        if state.closed:
            raise NodeLostError(
                f"another node of the launch closed the rendezvous at {self._watch.endpoint}: its launch ended (a "
                "rank failed there, its timeout expired, or it was stopped) while this node's ranks were running. "
                "Its own error is on that node. This node's workers have been stopped.",
                None,
                None,
                None,
                self._watch.endpoint,
            )
        return waiting

    def leave_barrier(self) -> None:
        """Check this node in at elastic's exit barrier, which its preempted launch never reaches."""
        if self._store is not None:
            notice.leave_barrier(self._store, len(self._participants) or self._watch.nnodes)

    def lost_peer(self) -> NodeLostError | None:
        """Return the error for the first other node that neither ended its launch nor beat within ``PROBE_WAIT`` s."""
        holder, state = getattr(self._handler, "_state_holder", None), self._state()
        if holder is None or state is None or self._store is None:
            return None
        pending = {node: rank for node, rank in self._participants.items() if rank != self._own}
        beats = {node: state.last_heartbeats.get(node) for node in pending}  # the peers' clocks: compared only
        deadline = time.monotonic() + PROBE_WAIT
        try:
            while pending:
                holder.sync()
                heartbeats = holder.state.last_heartbeats
                for node, rank in list(pending.items()):
                    alive = node in heartbeats and heartbeats[node] != beats[node]
                    if alive or self._store.check([f"mplaunch/ended/{rank}"]):
                        del pending[node]
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store is gone: the launch says so
            return None
        if not pending:
            return None
        rank, node = min((rank, node) for node, rank in pending.items())
        return self._lost(rank, node, f"it neither ended its launch nor sent a heartbeat for {PROBE_WAIT} s")

    def _lost(self, node_rank: int, node: Any, why: str = "") -> NodeLostError:
        host, pid = getattr(node, "addr", None), getattr(node, "pid", None)
        why = why or f"it sent no rendezvous heartbeat to {self._watch.endpoint} for {STORE_SILENCE} s"
        return NodeLostError(
            f"node {node_rank} of {self._watch.nnodes} (host {host}, launching process pid {pid}) is gone or cut off: "
            f"{why}. Its launching process was killed or stopped, its host is down, or the network to it is. This "
            "node's workers have been stopped.",
            node_rank,
            host,
            pid,
            self._watch.endpoint,
        )

    def _state(self) -> Any:
        """Return c10d's rendezvous state as last synced (elastic's private; ``None`` where not found)."""
        holder = getattr(self._handler, "_state_holder", None)
        return getattr(holder, "state", None)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    watch = params.config.pop(WATCH_KEY)
    params.backend = "c10d"  # the c10d handler checks its backend's name against the requested one
    return WatchedRendezvous(_create_c10d_handler(params), watch)


def register() -> None:
    """Register the ``mplaunch-c10d`` rendezvous backend with elastic (idempotent)."""
    _registry.register(BACKEND, _create)


def rendezvous_configs(watch: NodeWatch, join_timeout: float) -> dict[str, Any]:
    """Return the rendezvous configuration of a launch watched by ``watch``."""
    return {
        "join_timeout": join_timeout,
        "keep_alive_interval": KEEP_ALIVE_INTERVAL,
        "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT,
        WATCH_KEY: watch,
    }
