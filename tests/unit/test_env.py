"""The torchrun-style environment of a worker."""

from __future__ import annotations

import os
from typing import Any

import pytest

from mplaunch import worker_info
from mplaunch._env import RANK_VARIABLES, apply_environment, rank_environment, replacing


def test_rank_environment_follows_torchrun() -> None:
    env = rank_environment(1, 2, "127.0.0.1", 29500, agent_store=True)
    assert env["RANK"] == env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "0"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "TORCHELASTIC_USE_AGENT_STORE" not in rank_environment(0, 1, "h", 1, agent_store=False)


def test_apply_environment_drops_stale_rank_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "stale")
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("UNRELATED", "kept")
    environ = os.environ
    snapshot = dict(environ)
    try:
        apply_environment(environ, replacing(rank_environment(0, 1, "a", 1, agent_store=False)))
        assert environ["RANK"] == "0"
        assert "TORCHELASTIC_RUN_ID" not in environ
        assert environ["UNRELATED"] == "kept"
    finally:
        environ.clear()
        environ.update(snapshot)
    assert "TORCHELASTIC_RUN_ID" in RANK_VARIABLES


def test_worker_info_reads_the_environment() -> None:
    info = worker_info({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank) == (3, 1, 4, 2, 1)
    plain = worker_info({})
    assert (plain.rank, plain.world_size, plain.local_world_size) == (0, 1, 1)
    with pytest.raises(ValueError, match="RANK='x'"):
        worker_info({"RANK": "x"})


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"TORCHELASTIC_RUN_ID": "abc", "RANK": "1"}, "torchrun"),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, "slurm"),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, None),  # a task per node
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, None),  # a one-task step: launch as usual
        ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}, None),  # the batch script itself, not a task of srun
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
        ({"PMI_SIZE": "1"}, None),
        ({"TORCHELASTIC_RUN_ID": "abc", "MPLAUNCH_IN_PROCESS": "0"}, None),
        ({"MPLAUNCH_IN_PROCESS": "1"}, "forced"),
    ],
)
def test_outer_launcher_detection(environ: dict[str, str], expected: str | None) -> None:
    from mplaunch import outer_launcher

    assert outer_launcher(environ) == expected


def test_forced_in_process_call_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch import parallel

    monkeypatch.setenv("MPLAUNCH_IN_PROCESS", "1")
    assert parallel(nprocs=2, start_method="spawn")(os.getpid)() == os.getpid()
    assert parallel(nprocs=2, start_method="spawn", return_all=True)(os.getpid)() == [os.getpid()]


def test_node_setup_reads_arguments_then_mplaunch_then_slurm() -> None:
    from mplaunch._env import node_setup

    assert node_setup(None, None, None, {}) is None
    assert node_setup(1, None, None, {}) is None
    setup = node_setup(2, 1, "host", {})
    assert setup is not None
    assert (setup.nnodes, setup.node_rank, setup.rdzv_endpoint) == (2, 1, "host:29400")
    env = {"MPLAUNCH_NNODES": "3", "MPLAUNCH_NODE_RANK": "2", "MPLAUNCH_RDZV_ENDPOINT": "h:1", "MPLAUNCH_RUN_ID": "j"}
    setup = node_setup(None, None, None, env)
    assert setup is not None
    assert (setup.nnodes, setup.node_rank, setup.rdzv_endpoint, setup.run_id) == (
        3,
        2,
        "h:1",
        "j",
    )
    slurm = {  # the second node of an srun step of one task per node, as srun sets it
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": "node[01-02,07]",
        "SLURM_STEP_NODELIST": "node[02,07]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",  # where srun ran (a login node, maybe): not a node of the step
        "SLURM_JOB_ID": "77",
    }
    setup = node_setup(None, None, None, slurm)
    assert setup is not None
    assert (setup.nnodes, setup.node_rank, setup.rdzv_endpoint, setup.run_id) == (
        2,
        1,
        "node02:29400",  # the step's first node
        "77.0",
    )
    del slurm["SLURM_STEP_NODELIST"]  # (set by srun; sbatch's own script has the job's list only)
    assert getattr(node_setup(None, None, None, slurm), "rdzv_endpoint", None) == "node01:29400"
    assert getattr(node_setup(None, None, "h:5", slurm), "rdzv_endpoint", None) == "h:5"
    assert node_setup(None, None, None, {**slurm, "SLURM_STEP_NUM_TASKS": "8"}) is None  # tasks per rank: in-process
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        node_setup(2, None, None, {})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("hostA,hostB", "hostA"),
        ("node[1-2]", "node1"),
        ("node[01-02,07]", "node01"),  # zero padding is part of the name
        ("node[07,01-02]", "node07"),  # written order, as scontrol show hostnames lists it
        ("rack[2-3]-gpu[5,7],login1", "rack2-gpu5"),  # several ranges: the first of each
        ("gpu-a100.cluster[10-12].example", "gpu-a100.cluster10.example"),
        ("n[3]", "n3"),
        ("single", "single"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    from mplaunch._env import first_host

    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["[]", "n[1-2", "n[1-2]]", "n[a-b]", "n[]", ",n1", "a,,b", "a,b[1-"])
def test_a_malformed_slurm_host_list_is_refused_naming_the_variable(nodelist: str) -> None:
    from mplaunch import InvalidOptionError
    from mplaunch._env import node_setup

    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "x"}
    with pytest.raises(
        InvalidOptionError, match=r"SLURM_STEP_NODELIST \(else .* is not a SLURM host list.*MPLAUNCH_RDZV_EN"
    ):
        node_setup(None, None, None, {**env, "SLURM_STEP_NODELIST": nodelist})
    del env["SLURM_JOB_NODELIST"]  # no list at all: refused the same
    with pytest.raises(InvalidOptionError, match=r"SLURM_STEP_NODELIST \(else SLURM_JOB_NODELIST\) '' is not"):
        node_setup(None, None, None, env)


def test_bad_in_process_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from mplaunch import InvalidOptionError, outer_launcher, parallel

    with pytest.raises(ValueError, match="MPLAUNCH_IN_PROCESS='yes'"):
        outer_launcher({"MPLAUNCH_IN_PROCESS": "yes"})
    monkeypatch.setenv("MPLAUNCH_IN_PROCESS", "yes")
    with pytest.raises(InvalidOptionError, match="set it to 1"):
        parallel(nprocs=2, start_method="fork")(os.getpid)()


@pytest.mark.parametrize("port", ["abc", "\u00b3"])  # "³" passes str.isdigit(), then int() raised a ValueError
def test_bad_master_port_is_refused(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    from mplaunch import LaunchRefusedError, parallel

    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(LaunchRefusedError, match=f"MASTER_PORT='{port}' is not a TCP port"):
        parallel(nprocs=2, start_method="fork")(os.getpid)()


def test_counts_in_the_environment_are_ascii_whole_numbers() -> None:
    """OMP_NUM_THREADS="³" (str.isdigit() is true, int() refuses it) failed every launch with a bare
    ValueError, as did such a SLURM count; each is now read as no number, as "abc" is."""
    from mplaunch import outer_launcher
    from mplaunch._parent.policy import wanted_threads
    from mplaunch._platform.cpus import usable_cpu_count
    from mplaunch._worker.apply_placement import threads_in

    assert wanted_threads(1, {"OMP_NUM_THREADS": "\u00b3"}) == wanted_threads(1, {}) == usable_cpu_count()
    assert wanted_threads(1, {"OMP_NUM_THREADS": "3"}) == 3
    assert threads_in({"OMP_NUM_THREADS": "\u00b3"}) is None and threads_in({"OMP_NUM_THREADS": "3"}) == 3
    slurm = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "\u00b3", "SLURM_PROCID": "0"}
    assert outer_launcher(slurm) is None


def test_a_kept_environment_leaves_what_only_c_code_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """environ_kept put os.environ back by clearing it and setting every variable again, so after a spawn
    launch (which sets PYTHONHASHSEED while its workers start) a value set with os.putenv alone, or a
    removal with os.unsetenv alone, was undone in the C library's table."""
    import ctypes

    from mplaunch._platform.environ import environ_kept

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    monkeypatch.setenv("KEPT_PUT", "python")
    monkeypatch.setenv("KEPT_UNSET", "b")
    monkeypatch.delenv("KEPT_ADDED", raising=False)
    os.putenv("KEPT_PUT", "c-only")
    os.unsetenv("KEPT_UNSET")
    try:
        with environ_kept():
            os.environ["KEPT_ADDED"] = "1"
        assert "KEPT_ADDED" not in os.environ and getenv(b"KEPT_ADDED") is None
        assert (getenv(b"KEPT_PUT"), getenv(b"KEPT_UNSET")) == (b"c-only", None)
        assert (os.environ["KEPT_PUT"], os.environ["KEPT_UNSET"]) == ("python", "b")
    finally:
        os.putenv("KEPT_PUT", "python")  # as os.environ says, for monkeypatch to undo
        os.putenv("KEPT_UNSET", "b")


def _installed(environ: Any, names: list[str]) -> dict[str, Any]:
    """Fork, install ``environ`` in the child, and return what C's ``getenv`` and ``os.environ`` read there."""
    import ctypes
    import json

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            environ.install()
            found = {name: [(getenv(name.encode()) or b"?").decode(), os.environ.get(name, "?")] for name in names}
            os.write(write, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen: dict[str, Any] = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return seen


def test_fork_environs_follow_the_parents_changes_between_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's C table is read again when it changed (a new value of a variable, a new variable, one
    removed), not only when it moved; each child gets its own changes and the ones they share."""
    from mplaunch._platform.environ import fork_environs

    monkeypatch.setenv("FORK_ENV_KEPT", "1")
    monkeypatch.setenv("FORK_ENV_GONE", "1")
    names = ["FORK_ENV_KEPT", "FORK_ENV_GONE", "FORK_ENV_NEW", "SHARED", "OWN"]
    made = fork_environs({"SHARED": "s", "OWN": "x"}, [{"OWN": "0"}, {"OWN": "1", "FORK_ENV_KEPT": None}])
    assert made is not None
    assert _installed(made[0], names) == {
        "FORK_ENV_KEPT": ["1", "1"],
        "FORK_ENV_GONE": ["1", "1"],
        "FORK_ENV_NEW": ["?", "?"],
        "SHARED": ["s", "s"],
        "OWN": ["0", "0"],
    }
    assert _installed(made[1], names)["FORK_ENV_KEPT"] == ["?", "?"]
    assert _installed(made[1], names)["OWN"] == ["1", "1"]
    one = fork_environs({"SOMETIMES": "shared"}, [{"SOMETIMES": "mine"}, {}])  # changed again by one child only
    assert one is not None
    assert [_installed(each, ["SOMETIMES"]) for each in one] == [{"SOMETIMES": [v, v]} for v in ("mine", "shared")]
    monkeypatch.setenv("FORK_ENV_KEPT", "2")  # a new value: a new string in the same table
    monkeypatch.delenv("FORK_ENV_GONE")
    monkeypatch.setenv("FORK_ENV_NEW", "3")
    again = fork_environs({"SHARED": "t"}, [{}])
    assert again is not None
    assert _installed(again[0], names) == {
        "FORK_ENV_KEPT": ["2", "2"],
        "FORK_ENV_GONE": ["?", "?"],
        "FORK_ENV_NEW": ["3", "3"],
        "SHARED": ["t", "t"],
        "OWN": ["?", "?"],
    }
