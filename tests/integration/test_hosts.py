"""Multi-node launches across real network interfaces: hosts made of network namespaces on this machine, each
with its own address, name and hosts file (``tests/hosts.py``). Host names on ``127.0.1.1``, a host cut off in
the middle of a collective, a host that comes back, and SLURM's variables. Skipped where namespaces cannot be
made (not root), with the reason."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from tests.helpers import REPO, write_script
from tests.hosts import Host

pytestmark = pytest.mark.slow
MakeHosts = Callable[..., list[Host]]  # the ``hosts`` fixture

NODE = """
    import os, socket, sys, time
    import torch
    import torch.distributed as dist
    from mplaunch import parallel, worker_info

    def work(folder: str, loop: bool) -> dict:
        info = worker_info()
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        variables = [os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
        print(f"rank {info.rank} on {socket.gethostname()}: {variables} restart {info.restart_count}", flush=True)
        if loop and info.restart_count == 0:  # the first attempt: in a collective loop until the test acts
            with open(f"{folder}/ready{info.rank}", "w") as file:
                file.write(str(os.getppid()))  # the host's launching process
            while True:
                dist.all_reduce(total)
                time.sleep(0.01)
        return {"rank": info.rank, "host": socket.gethostname(), "sum": total.item(), "restart": info.restart_count,
                "run_id": os.environ["TORCHELASTIC_RUN_ID"]}

    if __name__ == "__main__":
        folder, loop, timeout, restarts, start_method = sys.argv[1:]
        launch = parallel(nprocs=1, start_method=start_method, backend="gloo", prefix_output=True, grace_period=2,
                          timeout=float(timeout) if timeout != "-" else None, max_restarts=int(restarts))(work)
        start, env = time.monotonic(), dict(os.environ)
        try:
            print("result", repr(launch(folder, loop == "loop")), flush=True)
        except Exception as error:
            print("failed", type(error).__name__, getattr(error, "node_rank", None), error, flush=True)
        print(f"ended after {time.monotonic() - start:.1f} s", flush=True)
        print("environment kept", env == dict(os.environ), flush=True)
        if loop == "loop":  # the process is usable afterwards: a launch on this host alone
            print("usable", parallel(nprocs=2, nnodes=1, start_method="fork", timeout=60)(os.getppid)() == os.getpid())
"""


def environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The hosts' environment: this checkout importable, none of the interface variables mplaunch sets."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def start(
    hosts: Sequence[Host], script: Path, args: Sequence[str], env: Mapping[str, str]
) -> list[subprocess.Popen[str]]:
    return [host.popen([sys.executable, str(script), *args], environment(env)) for host in hosts]


def ended(node: subprocess.Popen[str], within: float) -> tuple[str, str]:
    """The output of ``node`` once it ended, within ``within`` seconds (else it is killed and the test fails)."""
    try:
        return node.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        node.kill()
        out, err = node.communicate()
        pytest.fail(f"a host's call did not end within {within} s:\n{out}\n{err[-3000:]}")


def result_of(output: str) -> object:
    line = next(line for line in output.splitlines() if line.startswith(("result", "failed")))
    return ast.literal_eval(line.removeprefix("result ")) if line.startswith("result") else line


def wait_ready(folder: Path, count: int, nodes: Sequence[subprocess.Popen[str]]) -> None:
    """Wait until ``count`` ranks are in their collective loop."""
    deadline = time.monotonic() + 90
    while len(list(folder.glob("ready*"))) < count:
        if time.monotonic() > deadline or any(node.poll() is not None for node in nodes):
            pytest.fail(f"the ranks never started: {[ended(node, 10) for node in nodes]}")
        time.sleep(0.1)


def test_three_hosts_whose_names_are_on_loopback_form_one_group(tmp_path: Path, hosts: MakeHosts) -> None:
    """Each host's own name is on 127.0.1.1 (Debian's /etc/hosts), and each has a decoy interface before the one
    that reaches the others: gloo would bind loopback, NCCL the decoy. mplaunch gives the ranks the interface
    that reaches the other hosts; a variable the user set is kept. The endpoint is a host name."""
    made = hosts(["host1", "host2", "host3"])
    script = write_script(tmp_path, NODE)
    env = {"MPLAUNCH_NNODES": "3", "MPLAUNCH_RDZV_ENDPOINT": "host1"}
    nodes = start(made[:2], script, [str(tmp_path), "-", "60", "0", "fork"], env)
    nodes += start(made[2:], script, [str(tmp_path), "-", "60", "0", "fork"], {**env, "NCCL_SOCKET_IFNAME": "eth"})
    outputs = [ended(node, 120) for node in nodes]
    for out, err in outputs:  # rank 0's value on every host
        assert result_of(out) == {"rank": 0, "host": "host1", "sum": 6.0, "restart": 0, "run_id": "mplaunch"}, err
    for rank, (out, _) in enumerate(outputs):  # c10d orders the nodes by host name; each host routes its own rank
        nccl = "eth" if rank == 2 else "=eth1"
        assert [line for line in out.splitlines() if "rank" in line and "result" not in line] == [
            f"[rank {rank}] rank {rank} on host{rank + 1}: ['eth1', '{nccl}'] restart 0"
        ]
    assert [host.pids() for host in made] == [[], [], []]


@pytest.mark.parametrize(("cut", "timeout"), [(1, "60"), (0, "-")], ids=["other-host", "store-host-no-timeout"])
def test_a_host_cut_off_mid_collective_ends_every_hosts_call(
    tmp_path: Path, hosts: MakeHosts, cut: int, timeout: str
) -> None:
    """A host's cable is pulled while the ranks are in a collective loop: no process dies, the peers just stop
    answering. Every host's call ends with NodeLostError naming the other host, within the detection bound
    (10 s of silence, then grace_period), with a timeout or without one; nothing is left running. The store's
    host cut off is the hard case: torch's keep-alive on the other host blocks on the store, holding a lock."""
    made = hosts(["host1", "host2"])
    script = write_script(tmp_path, NODE)
    env = {"MPLAUNCH_NNODES": "2", "MPLAUNCH_RDZV_ENDPOINT": "host1:29400"}
    nodes = start(made, script, [str(tmp_path), "loop", timeout, "0", "fork"], env)
    wait_ready(tmp_path, 2, nodes)
    made[cut].unplug()
    cut_at = time.monotonic()
    outputs = [ended(node, 60) for node in nodes]
    took = time.monotonic() - cut_at
    assert took < 30, outputs  # detection: 10 s; the ranks stuck in gloo are killed after grace_period=2
    for rank, (out, err) in enumerate(outputs):
        other = 1 - rank
        assert f"failed NodeLostError {other} " in out, err[-3000:]
        assert "environment kept True" in out and "usable True" in out
        assert f"node {other} of 2 (host host{other + 1}, launching process pid {nodes[other].pid})" in out
        assert "is gone or cut off" in out
    assert "the rendezvous store at host1:29400 stopped answering" in outputs[1][0]  # host2 lost the store
    assert [host.pids() for host in made] == [[], []]


def test_a_host_killed_and_started_again_rejoins(tmp_path: Path, hosts: MakeHosts) -> None:
    """With max_restarts=1, a host's launching process is killed while the ranks are in a collective loop and
    started again with the same command: the other host restarts its ranks and waits, the new host joins, and
    the job completes from the next attempt on every host. The restart count is the job's, also on the new host;
    the earlier attempt's failure is announced (``RestartWarning``)."""
    made = hosts(["host1", "host2"])
    script = write_script(tmp_path, NODE)
    env = {"MPLAUNCH_NNODES": "2", "MPLAUNCH_RDZV_ENDPOINT": "host1:29400"}
    args = [str(tmp_path), "loop", "120", "1", "fork"]
    nodes = start(made, script, args, env)
    wait_ready(tmp_path, 2, nodes)
    nodes[1].kill()
    nodes[1].communicate()
    again = start(made[1:], script, args, env)[0]
    outputs = [ended(node, 90) for node in (nodes[0], again)]
    for out, err in outputs:
        assert result_of(out) == {"rank": 0, "host": "host1", "sum": 3.0, "restart": 1, "run_id": "mplaunch"}, err
    assert "[rank 1] rank 1 on host2: ['eth1', '=eth1'] restart 1" in outputs[1][0]
    warning = "RestartWarning: mplaunch: attempt 1 of 2 failed (rank 0 raised "
    assert warning in outputs[0][1] and "Connection reset by peer" in outputs[0][1], outputs[0][1][-3000:]
    assert [host.pids() for host in made] == [[], []]


def test_the_same_script_runs_on_each_host_of_a_slurm_job(tmp_path: Path, hosts: MakeHosts) -> None:
    """Each host gets the variables srun sets for a 2-node step of one task per node; the script names neither
    the nodes nor the endpoint: the endpoint is the first node of the step's list (SLURM's compressed form), the
    run id the job's step. Host names resolve to the hosts' own addresses here."""
    made = hosts(["node01", "node02"], own_name_on_loopback=False)
    script = write_script(tmp_path, NODE)
    nodes = []
    for node_id, host in enumerate(made):
        slurm = {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[01-02]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "node[01-02]",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_NODEID": str(node_id),
            "SLURM_PROCID": str(node_id),
            "SLURM_LOCALID": "0",
            "SLURMD_NODENAME": host.name,
            "SLURM_LAUNCH_NODE_IPADDR": "10.213.9.9",  # the login node srun ran on: no node of the job
        }
        nodes += start([host], script, [str(tmp_path), "-", "60", "0", "spawn"], slurm)
    for out, err in (ended(node, 120) for node in nodes):
        assert result_of(out) == {"rank": 0, "host": "node01", "sum": 3.0, "restart": 0, "run_id": "4242.0"}, err
    assert [host.pids() for host in made] == [[], []]
