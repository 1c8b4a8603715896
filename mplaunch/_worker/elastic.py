"""What a multi-node launch's worker runs under torch elastic's agent; rank 0's result is shared to every node."""

from __future__ import annotations

import os
import time

from mplaunch._env import WORKER_VARIABLE
from mplaunch._errors import NodeLostError
from mplaunch._output.rank_streams import take_fds
from mplaunch._wire import flags, pickling, transport
from mplaunch._wire.records import NODE_ROUND, REMOTE_RANK0, Outcome, Raised, Returned
from mplaunch._wire.spec import WorkerSpec
from mplaunch._worker.debugger import install_breakpoint_hook
from mplaunch._worker.entry import execute
from mplaunch._worker.outcome import exit_handlers, finish, write_outcome
from mplaunch._worker.setup import start
from mplaunch._worker.state import state


def elastic_entry(spec: WorkerSpec) -> int:
    """Run the function in a worker elastic started; return the global rank (a failed worker exits)."""
    outcome: Outcome | None = None
    written = False
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        os.environ.update(transport.load(spec.launch.directory, NODE_ROUND, private=False, remove=False))
        start(spec)
        take_fds(spec.attempt.output_fds, local_rank, rank)
        os.environ[WORKER_VARIABLE] = "1"
        install_breakpoint_hook(spec, rank)
        flags.attach(spec.launch.directory)  # this node's preemption flag, if the launch has one: mplaunch.preempted()
        outcome = execute(rank, local_rank, spec, None)
        if isinstance(outcome, Returned):
            outcome, written = write_outcome(spec, rank, outcome), True
            _share_rank0(spec, rank, local_rank, outcome)
    except BaseException:  # noqa: BLE001 - a stop that landed outside the function: reported by finish
        pass
    if not isinstance(outcome, Returned):
        finish(spec, rank, outcome, written=written)
    exit_handlers(spec)  # elastic's process then exits normally, with no handler left to run
    return rank


_CONNECT_WAIT = 5.0  # seconds to reach the rendezvous store (c10d may try twice): it answered a moment ago


def _share_rank0(spec: WorkerSpec, rank: int, local_rank: int, outcome: Outcome) -> None:
    """Publish rank 0's outcome for each other node's first worker, which waits ``result_wait`` s for it."""
    from datetime import timedelta

    from torch.distributed import DistStoreError, TCPStore  # type: ignore[attr-defined]

    on_first_node = os.environ.get("GROUP_RANK", "0") == "0"
    if rank != 0 and (on_first_node or local_rank != 0 or not isinstance(outcome, Returned)):
        return  # a failed worker does not wait for rank 0: its own failure is what this node reports
    key = f"mplaunch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank0"
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    deadline = time.monotonic() + spec.launch.result_wait
    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=min(_CONNECT_WAIT, spec.launch.result_wait)),
        )
        if rank == 0:
            store.set(key, pickling.to_bytes(outcome))  # type: ignore[arg-type]
            return
        while state.signal_received is None and not flags.is_set():  # stopped or preempted: rank 0's value is moot
            try:
                store.wait([key], timedelta(seconds=max(0.01, min(1.0, deadline - time.monotonic()))))
                break
            except DistStoreError:  # this second's wait ended
                if time.monotonic() >= deadline:
                    raise
        else:
            return  # stopped or preempted by the launch: the node's error is the launch's
        shared = pickling.from_bytes(store.get(key))
    except RuntimeError as error:  # torch's DistStoreError / DistNetworkError: a store gone or a wait expired
        if rank == 0:
            raise
        message = (
            f"rank 0's result did not reach node {os.environ.get('GROUP_RANK')} within {spec.launch.result_wait:g} s "
            f"(the rendezvous store at {address}: {type(error).__name__}: {error}). The node that ran rank 0 "
            "(node 0) is gone, or its store is: its launching process was killed or stopped."
        )
        lost = NodeLostError(message, 0, None, None, address)
        lost.__cause__ = error
        shared = Raised.of(lost)
    transport.dump(shared, spec.launch.directory, REMOTE_RANK0)
