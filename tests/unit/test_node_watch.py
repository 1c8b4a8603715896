"""The checks a multi-node launch makes between two looks of elastic's agent at its workers, in one process:
a fake c10d handler whose rendezvous state the test changes, and a real store for rank 0's result."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from mplaunch import LaunchTimeoutError, NodeLostError
from mplaunch._parent.nodes import handler as handler_module
from mplaunch._parent.nodes.handler import NodeWatch, WatchedRendezvous
from mplaunch._wire import transport
from mplaunch._wire.records import NODE_ROUND, REMOTE_RANK0, Raised, Returned
from mplaunch._wire.spec import LaunchSpec, WorkerSpec
from mplaunch._worker.elastic import _share_rank0
from tests.helpers import free_port


@dataclasses.dataclass(frozen=True, order=True)
class Node:  # as c10d's _NodeDesc
    addr: str
    pid: int
    local_id: int = 0


@dataclasses.dataclass
class State:
    round: int = 1
    closed: bool = False
    participants: dict[Node, int] = dataclasses.field(default_factory=dict)
    last_heartbeats: dict[Node, float] = dataclasses.field(default_factory=dict)


class Holder:
    def __init__(self, state: State) -> None:
        self.state = state
        self.beating: Node | None = None  # a node that sends a heartbeat at each sync

    def sync(self) -> None:
        if self.beating is not None:
            self.state.last_heartbeats[self.beating] += 1


class FakeHandler:
    """What WatchedRendezvous reads of elastic's DynamicRendezvousHandler."""

    def __init__(self, nodes: list[Node]) -> None:
        self._this_node = nodes[0]
        self._state_holder = Holder(State(participants={node: rank for rank, node in enumerate(nodes)}))
        self._state_holder.state.last_heartbeats = {node: 1.0 for node in nodes}
        self.store: dict[str, str] = {}
        self.fail: BaseException | None = None

    def next_rendezvous(self) -> Any:
        store = type("Store", (), {"set": self.store.__setitem__, "check": lambda _, keys: keys[0] in self.store})
        return type("Info", (), {"store": store()})()

    def shutdown(self) -> bool:
        return True

    def num_nodes_waiting(self) -> int:
        if self.fail is not None:
            raise self.fail
        return 0


def watched(timeout: float | None = None) -> tuple[WatchedRendezvous, FakeHandler, NodeWatch]:
    handler = FakeHandler([Node("node-a", 10), Node("node-b", 20)])
    watch = NodeWatch("node-a:29400", 2, timeout)
    rendezvous = WatchedRendezvous(handler, watch)
    rendezvous.next_rendezvous()
    return rendezvous, handler, watch


def test_a_node_dropped_from_the_round_is_named() -> None:
    rendezvous, handler, _ = watched()
    assert rendezvous.num_nodes_waiting() == 0
    del handler._state_holder.state.participants[Node("node-b", 20)]  # c10d dropped it: no heartbeat for 10 s
    with pytest.raises(NodeLostError, match=r"node 1 of 2 \(host node-b, launching process pid 20\)") as caught:
        rendezvous.num_nodes_waiting()
    assert (caught.value.node_rank, caught.value.host, caught.value.launcher_pid) == (1, "node-b", 20)
    error = pickle.loads(pickle.dumps(caught.value))
    assert (error.node_rank, error.launcher_pid, error.endpoint, str(error)) == (
        1,
        20,
        "node-a:29400",
        str(caught.value),
    )


def test_a_new_round_is_elastics_business() -> None:
    rendezvous, handler, _ = watched()
    handler._state_holder.state = State(round=2, participants={Node("node-a", 10): 0})
    assert rendezvous.num_nodes_waiting() == 0


def test_a_store_that_stops_answering_names_the_other_node_of_two() -> None:
    rendezvous, handler, _ = watched()
    handler.fail = RendezvousConnectionError("The connection to the C10d store has failed.")
    with pytest.raises(NodeLostError, match="stopped answering after the 2 nodes met") as caught:
        rendezvous.num_nodes_waiting()
    assert (caught.value.node_rank, caught.value.launcher_pid) == (1, 20)
    assert isinstance(caught.value.__cause__, RendezvousConnectionError)


def test_a_closed_rendezvous_ends_this_node() -> None:
    rendezvous, handler, _ = watched()
    handler._state_holder.state.closed = True
    with pytest.raises(NodeLostError, match="closed the rendezvous"):
        rendezvous.num_nodes_waiting()


def test_timeout_ends_this_node() -> None:
    rendezvous, _, watch = watched(timeout=30)
    watch.deadline = time.monotonic() - 1
    with pytest.raises(LaunchTimeoutError, match="within timeout=30 s") as caught:
        rendezvous.num_nodes_waiting()
    assert caught.value.timeout == 30


def test_the_wait_for_rank_0s_result_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's node never publishes (it is gone, the store lives on): node 1 stops waiting after result_wait."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    spec = WorkerSpec(LaunchSpec(str(tmp_path), 1, "fork", os.getpid(), 1, frozenset({0}), result_wait=1.5))
    start = time.monotonic()
    _share_rank0(spec, 2, 0, Returned(os.getpid(), None))
    assert time.monotonic() - start < 10
    record = transport.load(str(tmp_path), REMOTE_RANK0, private=False, remove=True)
    assert isinstance(record, Raised) and record.type_name == "mplaunch._errors.NodeLostError"
    assert "rank 0's result did not reach node 1 within 1.5 s" in record.message
    del server


def test_after_a_failure_a_node_that_neither_ended_nor_beats_is_lost() -> None:
    """A rank in a collective with a rank of the lost node fails first; the node is named after a few seconds."""
    rendezvous, handler, _ = watched()
    start = time.monotonic()
    lost = rendezvous.lost_peer()
    assert isinstance(lost, NodeLostError) and lost.node_rank == 1 and lost.launcher_pid == 20
    assert "neither ended its launch nor sent a heartbeat for 5 s" in str(lost)
    assert 4 < time.monotonic() - start < 10


def test_after_a_failure_a_node_that_ended_or_beats_is_not_lost() -> None:
    rendezvous, handler, _ = watched()
    handler._state_holder.beating = Node("node-b", 20)
    assert rendezvous.lost_peer() is None
    rendezvous, handler, _ = watched()
    handler.store["mplaunch/ended/1"] = "1"  # what node 1's shutdown writes
    assert rendezvous.lost_peer() is None
    rendezvous, handler, _ = watched()
    rendezvous.shutdown()
    assert handler.store == {"mplaunch/ended/0": "1"}  # this node marks the end of its own launch


def test_a_lost_node_restarts_the_others_while_restarts_remain() -> None:
    """With restarts left the node's workers restart (elastic's "nodes waiting"), and the lost node may rejoin; the
    loss is kept as the failure of the attempt (``earlier_attempts``)."""
    rendezvous, handler, watch = watched()  # the fake's round is 1: one restart is spent
    watch.max_restarts = 2
    del handler._state_holder.state.participants[Node("node-b", 20)]
    assert rendezvous.num_nodes_waiting() == 1
    assert isinstance(watch.lost_node, NodeLostError) and watch.lost_node.node_rank == 1
    watch.max_restarts = 1
    with pytest.raises(NodeLostError, match="node 1 of 2"):
        rendezvous.num_nodes_waiting()


def test_each_round_records_its_variables_for_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round is the restart count on every node; gloo's and NCCL's interface is the one that reaches the other
    nodes (here on this machine: loopback), unless set here."""
    handler = FakeHandler([Node("node-a", 10), Node("127.0.0.1", 20)])
    watch = NodeWatch("node-a:29400", 2, None, directory=str(tmp_path))
    WatchedRendezvous(handler, watch).next_rendezvous()
    assert transport.load(str(tmp_path), NODE_ROUND, private=False, remove=False) == {
        "TORCHELASTIC_RESTART_COUNT": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "=lo",  # NCCL reads a name as a prefix, "=" as the name exactly
    }
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    handler._state_holder.state.round = 2
    watch.peers = {}
    rendezvous = WatchedRendezvous(handler, watch)
    rendezvous.next_rendezvous()
    assert transport.load(str(tmp_path), NODE_ROUND, private=False, remove=False) == {
        "TORCHELASTIC_RESTART_COUNT": "2",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_a_silent_store_is_named_by_its_host_among_three() -> None:
    watch = NodeWatch("node-c:29400", 3, None)
    watch.peers = {1: ("node-b.example", 20), 2: ("node-c.example", 30)}  # c10d's addresses: fully qualified
    error = watch.store_error(RendezvousConnectionError("silent"))
    assert (error.node_rank, error.host, error.launcher_pid) == (2, "node-c.example", 30)
    assert "node 2 of 3 (host node-c.example, launching process pid 30), which hosts it, is gone or cut off" in str(
        error
    )


class Silent:
    """A TCP listener that accepts and never answers, as a store cut off from this host; a connection to it from
    a thread blocked reading (as torch's calls on a store block), and one to another port that must stay."""

    def __init__(self) -> None:
        self.listener, self.other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.blocked = socket.create_connection(("127.0.0.1", self.port))
        self.kept = socket.create_connection(self.other.getsockname())
        self.ended: list[float] = []
        self.reader = threading.Thread(target=self.read)
        self.reader.start()

    def read(self) -> None:
        with contextlib.suppress(OSError):  # (closed at the end of a test where it stays blocked)
            self.blocked.recv(1)
            self.ended.append(time.monotonic())

    def close(self) -> None:
        for sock in (self.blocked, self.kept, self.listener, self.other):
            sock.close()
        self.reader.join(5)


def test_a_store_silent_for_store_silence_seconds_is_lost_and_its_connections_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host cut off from the store, torch's calls on it block for minutes (c10d's keep-alive holding the
    handler's lock): once c10d has not heard from the store for STORE_SILENCE s, the watch shuts this process's
    connections to it, so they end."""
    monkeypatch.setattr(handler_module, "STORE_SILENCE", 1.0)
    silent = Silent()
    watch = NodeWatch(f"127.0.0.1:{silent.port}", 2, None)
    try:
        with watch.guarded():
            start = time.monotonic()
            watch.holder = types.SimpleNamespace(_last_sync_time=start)  # c10d's last answer from the store
            watch.joined = True
            silent.reader.join(10)
        assert silent.ended and 0.9 < silent.ended[0] - start < 5
        assert str(watch.store_lost) == "it did not answer for 1.0 s"
        silent.kept.settimeout(0.2)
        with pytest.raises(TimeoutError):  # a connection to another port is left alone
            silent.kept.recv(1)
    finally:
        silent.close()


def test_timeout_cuts_the_stores_connections() -> None:
    """``timeout`` bounds the call whatever torch waits for (the exit barrier, a join, a close)."""
    silent = Silent()
    watch = NodeWatch(f"127.0.0.1:{silent.port}", 2, 0.5)
    try:
        with watch.guarded():
            silent.reader.join(10)
        assert silent.ended and watch.store_lost is None
        with pytest.raises(LaunchTimeoutError, match="within timeout=0.5 s"):
            watch.check_deadline()
    finally:
        silent.close()
