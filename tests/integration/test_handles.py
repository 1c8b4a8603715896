"""Objects that multiprocessing sends only to a starting process (queues, locks, Events, shared values, Pipe ends,
Manager proxies, torch.multiprocessing queues) as arguments, as ``torch.multiprocessing.spawn(args=...)``
accepts them: under every start method, nested in containers, dataclasses and plain objects, with a call and
with ``submit()``."""

from __future__ import annotations

import multiprocessing
import multiprocessing.managers
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from mplaunch import LaunchRefusedError, StartMethod, parallel
from tests import workers
from tests.helpers import REPO, free_port, outputs_of, write_script

ALL_METHODS = ["fork", "forkserver", "spawn"]
TIMEOUT = 90  # only a deadlock reaches it


@pytest.mark.parametrize("start_method", ALL_METHODS)
def test_start_objects_reach_every_rank(start_method: StartMethod) -> None:
    context = multiprocessing.get_context(start_method)
    queue = context.Queue()
    tensors = torch.multiprocessing.get_context(start_method).Queue()
    tensor = torch.zeros(3)
    tensors.put(tensor)  # moved to torch's shared memory: rank 0's in-place update shows here
    log = workers.LogQueue(context.Queue())
    sync = {"event": context.Event(), "barrier": context.Barrier(2), "tensors": tensors, "log": log}
    value, counter = context.Value("i", 0), workers.Counter(context.RawValue("i", 0), context.Lock())
    receiver, sender = context.Pipe(duplex=False)
    run = parallel(nprocs=2, start_method=start_method, return_all=True, timeout=TIMEOUT)(workers.use_start_objects)
    try:
        # a Manager of its own authkey, which only a worker being started receives; shut down here
        with multiprocessing.managers.SyncManager(authkey=b"mplaunch-test") as manager:
            shared = manager.dict()
            assert run(queue, sync, [value, counter], sender, shared=shared) == [0, 1]
            pids = dict(shared)
        assert sorted(queue.get(timeout=TIMEOUT) for _ in range(2)) == [0, 1]
        assert value.value == 2
        assert counter.value.value == 2
        assert sorted(pids) == [0, 1]
        assert len(set(pids.values())) == 2
        assert receiver.poll(TIMEOUT)
        assert receiver.recv() == "hello from rank 0"
        assert torch.equal(tensor, torch.ones(3))
        records = [log.queue.get(timeout=TIMEOUT) for _ in range(2)]
        assert sorted(r.getMessage() for r in records) == [f"rank {r} logs through the queue" for r in (0, 1)]
    finally:
        receiver.close()
        sender.close()
        for each in (queue, tensors, log.queue):
            each.close()
            each.join_thread()


def test_submit_sends_a_queue() -> None:
    queue = multiprocessing.get_context("forkserver").SimpleQueue()
    run = parallel(nprocs=2, start_method="forkserver", return_all=True, timeout=TIMEOUT)(workers.put_rank)
    try:
        assert run.submit(queue).result(TIMEOUT) == [0, 1]
        assert sorted([queue.get(), queue.get()]) == [0, 1]
    finally:
        queue.close()


def test_a_lock_made_in_a_fork_context_is_refused_before_any_worker_starts() -> None:
    """A spawned or forkserver process cannot open a fork context's semaphore (it is unlinked at once):
    refused with the fix, as ``Process.start()`` would fail, before any worker starts."""
    run = parallel(nprocs=2, start_method="spawn", timeout=TIMEOUT)(workers.put_rank)
    with pytest.raises(LaunchRefusedError, match=r"the Lock .* 'fork' context .*get_context\('spawn'\)"):
        run([multiprocessing.get_context("fork").Lock()])


NODE = """
    import multiprocessing, sys
    from mplaunch import parallel, worker_info

    @parallel(nprocs=1, start_method="spawn", nnodes=2, rdzv_endpoint=sys.argv[1], timeout=120)
    def work(queue, conn) -> int:
        queue.put(worker_info().rank)
        conn.send(worker_info().rank)
        return worker_info().rank

    if __name__ == "__main__":
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        receiver, sender = context.Pipe(duplex=False)
        result = work(queue, sender)
        print("got", result, queue.get(timeout=60), receiver.recv() if receiver.poll(60) else None, flush=True)
"""


@pytest.mark.slow
def test_each_node_sends_its_objects_to_its_own_ranks(tmp_path: Path) -> None:
    script = write_script(tmp_path, NODE)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script), endpoint]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = outputs_of(nodes, timeout=150)
    assert sorted(outputs) == ["got 0 0 0\n", "got 0 1 1\n"], outputs  # rank 0's value; the node's own rank
