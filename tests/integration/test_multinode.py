"""Multi-node launches through torch.distributed.elastic, as two "nodes" on this machine (loopback only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, outputs_of, started_nodes, write_script

pytestmark = pytest.mark.slow

NODE = """
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from mplaunch import parallel, worker_info

    @parallel(nprocs=1, start_method="fork", nnodes=2, rdzv_endpoint=sys.argv[1], backend="gloo", timeout=120,
              rdzv_timeout=float(sys.argv[3]))
    def work(fail_rank: int) -> dict:
        info = worker_info()
        if info.rank == fail_rank:
            raise ValueError(f"rank {info.rank} fails on purpose")
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        return {"rank": info.rank, "world": info.world_size, "sum": total.item()}

    if __name__ == "__main__":
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
        env = dict(os.environ)
        try:
            print("result", work(int(sys.argv[2])), flush=True)
        except ValueError as error:
            print("ValueError", error, "rank", error.rank, flush=True)
        except Exception as error:
            print("failed", type(error).__name__, flush=True)
        now = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
        print("handlers kept", handlers == now)
        print("environment kept", env == dict(os.environ))
"""


def run_nodes(tmp_path: Path, count: int, fail_rank: int, rdzv_timeout: float = 60) -> list[str]:
    script = write_script(tmp_path, NODE)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir)}
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), endpoint, str(fail_rank), str(rdzv_timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    outputs = outputs_of(nodes, timeout=150)
    leftovers = [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
    assert leftovers == []  # no log or error files left behind
    for output in outputs:
        assert "handlers kept True" in output, output
        assert "environment kept True" in output, output
    return outputs


def test_two_nodes_all_reduce_and_both_get_rank0_result(tmp_path: Path) -> None:
    outputs = run_nodes(tmp_path, 2, fail_rank=-1)
    for output in outputs:
        assert "result {'rank': 0, 'world': 2, 'sum': 3.0}" in output, output


def test_a_failing_worker_fails_its_node_with_the_original_type(tmp_path: Path) -> None:
    outputs = run_nodes(tmp_path, 2, fail_rank=1)
    assert sum("ValueError rank 1 fails on purpose rank 1" in output for output in outputs) == 1, outputs
    assert all("result" not in output for output in outputs)  # the other node fails too, it does not hang


def test_a_missing_node_is_a_bounded_wait_with_a_clear_error(tmp_path: Path) -> None:
    start = time.monotonic()
    (output,) = run_nodes(tmp_path, 1, fail_rank=-1, rdzv_timeout=3)
    assert "failed LaunchTimeoutError" in output
    assert time.monotonic() - start < 60


OUTPUT = """
    import os, subprocess, sys
    from mplaunch import parallel, worker_info

    @parallel(nprocs=1, start_method=sys.argv[3], nnodes=2, rdzv_endpoint=sys.argv[1], timeout=120,
              prefix_output=True, console_ranks=[1], log_dir=sys.argv[2])
    def hello() -> int:
        rank = worker_info().rank
        print(f"hello from rank {rank}")
        os.write(2, f"fd 2 of rank {rank}\\n".encode())
        subprocess.run(["echo", f"echo of rank {rank}"], check=True)
        return rank

    if __name__ == "__main__":
        print("result", hello(), flush=True)
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_each_node_routes_the_output_of_its_own_ranks(tmp_path: Path, start_method: str) -> None:
    script, logs = write_script(tmp_path, OUTPUT), tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, str(script), endpoint, str(logs), start_method]
    nodes: list[subprocess.Popen[str]] = []
    try:
        nodes = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)
        ]
        outputs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    out = "".join(stdout for stdout, _ in outputs)
    assert sorted(line for line in out.splitlines() if "rank" in line) == [
        "[rank 1] echo of rank 1",
        "[rank 1] hello from rank 1",
    ], outputs
    assert sum("[rank 1] fd 2 of rank 1\n" in stderr for _, stderr in outputs) == 1, outputs
    assert "of rank 0" not in "".join(stderr for _, stderr in outputs)
    for rank in (0, 1):
        assert sorted((logs / f"rank{rank}.log").read_text().splitlines()) == [
            f"[rank {rank}] echo of rank {rank}",
            f"[rank {rank}] fd 2 of rank {rank}",
            f"[rank {rank}] hello from rank {rank}",
        ]


LOST = """
    import os, sys, time
    import torch.distributed as dist
    from mplaunch import parallel, worker_info

    @parallel(nprocs=1, start_method="fork", nnodes=2, rdzv_endpoint=sys.argv[1], backend="gloo",
              timeout=float(sys.argv[3]), rdzv_timeout=60)
    def work(ready: str, hanging: list[int]) -> int:
        rank = worker_info().rank
        dist.barrier()
        with open(f"{ready}/rank{rank}.tmp", "w") as file:
            file.write(str(os.getppid()))  # the node's launching process
        os.rename(f"{ready}/rank{rank}.tmp", f"{ready}/rank{rank}")
        if rank in hanging:
            time.sleep(3600)
        return rank

    if __name__ == "__main__":
        try:
            print("result", work(sys.argv[2], [int(r) for r in sys.argv[4].split(",") if r]), flush=True)
        except Exception as error:
            lost = getattr(error, "node_rank", None), getattr(error, "launcher_pid", None)
            print("failed", type(error).__name__, *lost, error, flush=True)
"""


@contextlib.contextmanager
def lost_nodes(tmp_path: Path, timeout: float, hanging: str) -> Iterator[tuple[list[subprocess.Popen[str]], Path]]:
    """Start two nodes of the LOST script, the first one hosting the rendezvous store (it is listening when
    the second starts); yield them and the folder where each rank writes its node's launcher pid; kill what
    is left at the end."""
    script, ready, shm = write_script(tmp_path, LOST), tmp_path / "ready", tmp_path / "shm"
    ready.mkdir()
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLAUNCH_SHM_DIR": str(shm)}  # a killed node leaves its own
    port = free_port()
    command = [sys.executable, str(script), f"127.0.0.1:{port}", str(ready), str(timeout), hanging]
    with started_nodes(command, env, port) as nodes:
        yield nodes, ready


def wait_ready(nodes: list[subprocess.Popen[str]], ready: Path) -> dict[int, subprocess.Popen[str]]:
    """Wait until both ranks ran their barrier; return the node that runs each rank."""
    deadline = time.monotonic() + 90
    while not all((ready / f"rank{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "ranks never started"
        time.sleep(0.1)
    by_pid = {node.pid: node for node in nodes}
    return {rank: by_pid[int((ready / f"rank{rank}").read_text())] for rank in (0, 1)}


def finish(node: subprocess.Popen[str], bound: float) -> tuple[str, float]:
    """Wait for ``node`` at most ``bound`` seconds; return its output and how long it took."""
    start = time.monotonic()
    output = node.communicate(timeout=bound)[0]
    return output, time.monotonic() - start


def test_a_killed_node_is_named_by_the_other_within_the_bound(tmp_path: Path) -> None:
    with lost_nodes(tmp_path, timeout=300, hanging="0,1") as (nodes, ready):
        by_rank = wait_ready(nodes, ready)
        by_rank[1].kill()  # node 1's launching process: its ranks die with it
        output, _ = finish(by_rank[0], bound=60)  # well inside timeout=300: never a silent hang
    assert f"failed NodeLostError 1 {by_rank[1].pid} node 1 of 2 (host" in output, output
    assert "is gone or cut off: it sent no rendezvous heartbeat" in output


def test_a_killed_store_host_running_rank0_is_named_not_a_rendezvous_timeout(tmp_path: Path) -> None:
    with lost_nodes(tmp_path, timeout=300, hanging="0") as (nodes, ready):  # rank 1 returns, waits for rank 0's
        by_rank = wait_ready(nodes, ready)
        assert by_rank[0] is nodes[0]  # c10d orders the nodes by pid: the store host is node 0
        by_rank[0].kill()
        output, _ = finish(by_rank[1], bound=60)  # well inside timeout=300: never a silent hang
    assert f"failed NodeLostError 0 {by_rank[0].pid} the rendezvous store at" in output, output
    assert "node 0 of 2" in output and "which hosts it, is gone" in output


def test_timeout_bounds_a_multinode_launch(tmp_path: Path) -> None:
    start = time.monotonic()
    with lost_nodes(tmp_path, timeout=6, hanging="0,1") as (nodes, _):
        first, second = (finish(node, bound=90)[0] for node in nodes)
    assert "failed LaunchTimeoutError None None the multi-node launch did not finish within timeout=6 s" in first
    # the second node started later: its own timeout stops it, or the end of the first node (the store's host)
    assert "failed LaunchTimeoutError" in second or "failed NodeLostError" in second, second
    assert time.monotonic() - start < 40
