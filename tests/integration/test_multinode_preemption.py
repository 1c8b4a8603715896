"""Preemption of a multi-node launch, as two "nodes" on this machine (loopback only)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, gone, started_nodes, write_script

pytestmark = pytest.mark.slow

NODE = """
    import os, signal, sys, time
    import torch.distributed as dist
    import mplaunch
    from mplaunch import parallel, worker_info

    def work(folder: str, hanging: list[int], node: int) -> int:
        rank = worker_info().rank
        dist.barrier()
        with open(f"{folder}/rank{rank}.tmp", "w") as file:
            file.write(str(node))  # the node's launching process
        os.rename(f"{folder}/rank{rank}.tmp", f"{folder}/rank{rank}")
        while not mplaunch.preempted() or rank in hanging:
            time.sleep(0.01)
        with open(f"{folder}/saved{rank}", "w") as file:
            file.write(str(os.getpid()))
        return rank + 10

    if __name__ == "__main__":
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)]
        env = dict(os.environ)
        # a submitted launch takes no preempt_signals (its thread cannot handle them): the caller's own handler
        signals = (signal.SIGTERM,) if sys.argv[6] == "call" else ()
        launch = parallel(nprocs=1, start_method=sys.argv[5], nnodes=2, rdzv_endpoint=sys.argv[1], backend="gloo",
                          timeout=120, rdzv_timeout=60, preempt_signals=signals,
                          preempt_grace=float(sys.argv[3]))(work)
        arguments = (sys.argv[2], [int(r) for r in sys.argv[4].split(",") if r], os.getpid())
        try:
            if sys.argv[6] == "submit":  # the caller's own handler preempts it
                future = launch.submit(*arguments)
                signal.signal(signal.SIGTERM, lambda signum, frame: future.preempt())
                handlers[1] = signal.getsignal(signal.SIGTERM)
                print("result", future.result(), flush=True)
            else:
                print("result", launch(*arguments), flush=True)
        except mplaunch.PreemptedError as error:
            print("preempted", error.signal_name, error.values, error.stopped, error, flush=True)
        except Exception as error:
            print("failed", type(error).__name__, error, flush=True)
        now = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)]
        print("handlers kept", handlers == now, flush=True)
        print("environment kept", env == dict(os.environ), flush=True)
"""


@contextlib.contextmanager
def two_nodes(
    tmp_path: Path, grace: float, hanging: str = "", start_method: str = "fork", how: str = "call"
) -> Iterator[tuple[dict[int, subprocess.Popen[str]], Path]]:
    """Start two nodes of the NODE script, the first one hosting the rendezvous store; wait until both ranks
    passed their barrier; yield each rank's node and the folder of the ranks' files. Check at the end that
    nothing is left: processes, launch directories, files in the nodes' temp dir."""
    script, folder, shm, tmpdir = (write_script(tmp_path, NODE), *(tmp_path / d for d in ("ranks", "shm", "tmp")))
    for path in (folder, shm, tmpdir):
        path.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLAUNCH_SHM_DIR": str(shm), "TMPDIR": str(tmpdir)}
    port = free_port()
    command = [sys.executable, str(script), f"127.0.0.1:{port}", str(folder), str(grace), hanging, start_method, how]
    with started_nodes(command, env, port) as nodes:
        deadline = time.monotonic() + 90
        while not all((folder / f"rank{rank}").exists() for rank in (0, 1)):
            ended = [node.communicate() for node in nodes if node.poll() is not None]
            assert time.monotonic() < deadline and not ended, f"ranks never started: {ended}"
            time.sleep(0.1)
        by_pid = {node.pid: node for node in nodes}
        yield {rank: by_pid[int((folder / f"rank{rank}").read_text())] for rank in (0, 1)}, folder
    workers = [int((folder / f"saved{rank}").read_text()) for rank in (0, 1) if (folder / f"saved{rank}").exists()]
    assert gone(workers)
    assert os.listdir(shm) == []  # every launch directory removed
    assert [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []


def outputs(nodes: dict[int, subprocess.Popen[str]], bound: float) -> dict[int, str]:
    """Each rank's node's output, waiting at most ``bound`` seconds for each; checks what every node keeps."""
    found = {rank: node.communicate(timeout=bound)[0] for rank, node in nodes.items()}
    for output in found.values():
        assert "handlers kept True" in output, output
        assert "environment kept True" in output, output
    return found


@pytest.mark.parametrize(("start_method", "how"), [("fork", "call"), ("spawn", "call"), ("forkserver", "submit")])
def test_sigterm_to_every_node_tells_every_rank_and_each_node_raises(
    tmp_path: Path, start_method: str, how: str
) -> None:
    with two_nodes(tmp_path, grace=60, start_method=start_method, how=how) as (nodes, folder):
        for node in nodes.values():
            node.send_signal(signal.SIGTERM)
        start = time.monotonic()
        found = outputs(nodes, bound=60)
        took = time.monotonic() - start
    by = "SIGTERM SIGTERM" if how == "call" else "None future.preempt()"  # a submitted launch: the caller's handler
    signal_name, cause = by.split()
    assert found[0].startswith(f"preempted {signal_name} {{0: 10}} () the launch was preempted by {cause}"), found[0]
    assert found[1].startswith(f"preempted {signal_name} {{1: None}} () the launch was preempted by {cause}"), found[1]
    assert (folder / "saved0").exists() and (folder / "saved1").exists()
    assert took < 30  # well inside the grace of 60 s and elastic's exit barrier of 300 s: nobody waited


def test_sigterm_to_one_node_reaches_the_ranks_of_the_other(tmp_path: Path) -> None:
    with two_nodes(tmp_path, grace=60) as (nodes, folder):
        nodes[1].send_signal(signal.SIGTERM)  # the node that does not host the store
        found = outputs(nodes, bound=60)
    assert found[1].startswith("preempted SIGTERM {1: None} () the launch was preempted by SIGTERM ("), found[1]
    assert found[0].startswith("preempted SIGTERM {0: 10} () the launch was preempted by SIGTERM, received by node"), (
        found[0]
    )
    assert (folder / "saved0").exists() and (folder / "saved1").exists()


def test_a_rank_still_running_after_the_grace_is_stopped_and_the_other_node_does_not_wait(tmp_path: Path) -> None:
    with two_nodes(tmp_path, grace=2, hanging="1") as (nodes, folder):
        for node in nodes.values():
            node.send_signal(signal.SIGTERM)
        start = time.monotonic()
        found = outputs(nodes, bound=90)
        took = time.monotonic() - start
    assert found[0].startswith("preempted SIGTERM {0: 10} () "), found[0]
    assert found[1].startswith("preempted SIGTERM {} (1,) "), found[1]
    assert not (folder / "saved1").exists()
    assert took < 60  # rank 0's node checked in at elastic's exit barrier: no 300 s wait
