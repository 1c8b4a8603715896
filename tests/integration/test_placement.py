"""Placement: devices= (with an injected device list: no GPU needed), cpu_binding=, env=, prefix templates."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mplaunch import InvalidOptionError, StartMethod, parallel
from mplaunch._parent import devices
from tests import workers
from tests.helpers import REPO, run_script, write_script


@pytest.fixture
def two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _wait_for(path: Path, count: int, pattern: str) -> list[Path]:
    deadline = time.monotonic() + 60
    while len(found := sorted(path.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"only {found}"
        time.sleep(0.01)
    return found


@pytest.mark.usefixtures("two_devices")
def test_one_device_trials_share_two_devices_at_most_two_at_once(tmp_path: Path) -> None:
    trial = parallel(start_method="fork", timeout=120)(workers.device_trial).options(devices=1)
    futures = [trial.submit(str(tmp_path), f"t{n}") for n in range(4)]
    started = _wait_for(tmp_path, 2, "*.start")
    queued = [f for n, f in enumerate(futures) if not (tmp_path / f"t{n}.start").exists()]
    assert len(queued) == 2
    assert not any(f.running() or f.done() for f in queued)
    assert {p.read_text().split()[1] for p in started} == {"0", "1"}
    assert devices.pool().busy() == {0, 1}
    (tmp_path / "release").touch()
    results = [f.result(timeout=120) for f in futures]
    assert set(results) <= {"0", "1"}  # a queued trial takes the device freed first: either, maybe both the same
    spans: list[tuple[float, float, str]] = []
    for n in range(4):
        start, device = (tmp_path / f"t{n}.start").read_text().split()
        spans.append((float(start), float((tmp_path / f"t{n}.end").read_text()), device))
    for begin, _, _ in spans:  # when each trial began, at most 2 ran, never 2 on one device
        running = [d for b, e, d in spans if b <= begin <= e]
        assert len(running) <= 2
        assert len(set(running)) == len(running)
    assert devices.pool().busy() == set()


@pytest.mark.usefixtures("two_devices")
def test_bad_device_indices_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    marker = str(tmp_path / "started")
    touch = parallel(start_method="fork", timeout=60)(workers.touch)
    with pytest.raises(InvalidOptionError, match=r"\[2\].*visible devices are 0 \(0\), 1 \(1\)"):
        touch.options(devices=[0, 2])(marker)
    future = touch.options(devices=3).submit(marker)
    assert isinstance(future.exception(timeout=10), InvalidOptionError)
    assert not os.path.exists(marker)
    assert devices.pool().busy() == set()


def test_devices_are_named_as_the_parent_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    seen = parallel(start_method="fork", timeout=60, return_all=True)(workers.placement_seen)
    assert [r["cuda"] for r in seen.options(devices=[2, 1])()] == ["6,5", "6,5"]  # nprocs="auto": 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"


@pytest.mark.usefixtures("two_devices")
def test_a_queued_launch_can_be_cancelled_and_devices_come_back(tmp_path: Path) -> None:
    trial = parallel(start_method="fork", timeout=120)(workers.device_trial)
    holder = trial.options(devices=2, nprocs=1).submit(str(tmp_path), "holder")
    _wait_for(tmp_path, 1, "holder.start")
    queued = trial.options(devices=1).submit(str(tmp_path), "queued")
    assert not queued.running()
    assert queued.cancel()
    assert queued.cancelled()
    (tmp_path / "release").touch()
    assert holder.result(timeout=120) == "0,1"
    assert not (tmp_path / "queued.start").exists()
    assert devices.pool().busy() == set()


def test_cpu_binding_cores_gives_each_rank_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        pytest.skip("needs 2 CPUs")
    seen = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True, cpu_binding="cores")(
        workers.placement_seen
    )()
    sets = [set(r["cpus"]) for r in seen]
    assert all(sets)
    assert not sets[0] & sets[1]
    assert sets[0] | sets[1] <= mask
    assert [r["omp"] for r in seen] == [str(len(s)) for s in sets] == [str(r["threads"]) for r in seen]
    assert os.sched_getaffinity(0) == mask


def test_cpu_binding_numa_pins_to_a_node_within_the_mask() -> None:
    from mplaunch._platform import topology

    mask = os.sched_getaffinity(0)
    seen = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True, cpu_binding="numa")(
        workers.placement_seen
    )()
    nodes = topology.numa_nodes()
    for result in seen:
        assert set(result["cpus"]) <= mask
        assert not nodes or any(set(result["cpus"]) == set(cpus) & mask for cpus in nodes.values())
    assert os.sched_getaffinity(0) == mask


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_env_reaches_each_rank_and_leaves_the_parent_alone(start_method: StartMethod) -> None:
    seen = parallel(nprocs=2, start_method=start_method, timeout=120, return_all=True)(workers.placement_seen)
    given = {"PLACEMENT_A": "a b", "PLACEMENT_EMPTY": ""}
    assert seen.options(env=given)()[1]["extra"] == given
    assert [r["extra"] for r in seen.options(env=lambda rank: {"PLACEMENT_R": f"r{rank}"})()] == [
        {"PLACEMENT_R": "r0"},
        {"PLACEMENT_R": "r1"},
    ]
    assert not any(name.startswith("PLACEMENT_") for name in os.environ)


ENV_IN_TIME = """
    import json, os, sys, warnings
    import reads_at_import
    from mplaunch import parallel

    def seen():
        import on_given_path
        try:
            warnings.warn("a warning", UserWarning)
            warned = "warned"
        except UserWarning:
            warned = "raised"
        rank = int(os.environ["RANK"])
        return [reads_at_import.VALUE, hash("mplaunch"), on_given_path.VALUE, warned, rank]

    if __name__ == "__main__":
        extra = sys.argv[1]
        for method in sys.argv[2:]:
            env = lambda rank: {
                "ENV_IN_TIME": f"rank {rank}",
                "PYTHONHASHSEED": str(rank + 1),
                "PYTHONPATH": extra,
                "PYTHONWARNINGS": "error::UserWarning",
            }
            print(json.dumps(parallel(nprocs=2, start_method=method, env=env, return_all=True, timeout=120)(seen)()))
"""


def test_env_is_in_place_before_a_spawned_ranks_interpreter_starts(tmp_path: Path) -> None:
    """Issue 37: env= was applied after the rank's interpreter had started and imported the script's modules:
    a module reading os.environ at import, PYTHONHASHSEED, PYTHONPATH and PYTHONWARNINGS saw the parent's
    values (forkserver ranks: the fork server's). Now spawn ranks are started with them, forkserver ranks
    with env= are started as spawn ones (the server's interpreter cannot take them), and PYTHONPATH and
    PYTHONWARNINGS survive multiprocessing's sys.path and mplaunch's warning filters."""
    import subprocess
    import sys

    (tmp_path / "reads_at_import.py").write_text("import os\nVALUE = os.environ.get('ENV_IN_TIME')\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "on_given_path.py").write_text("VALUE = 'found'\n")
    script = write_script(tmp_path, ENV_IN_TIME)
    done = run_script(script, str(extra), "spawn", "forkserver", timeout=300)
    assert done.returncode == 0, done.stderr
    hashes = [
        int(
            subprocess.run(
                [sys.executable, "-c", "print(hash('mplaunch'))"],
                env={"PYTHONHASHSEED": seed},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for seed in ("1", "2")
    ]
    for line in done.stdout.splitlines()[-2:]:
        assert json.loads(line) == [[f"rank {r}", hashes[r], "found", "raised", r] for r in (0, 1)]


def test_under_fork_env_takes_what_can_change_and_refuses_what_cannot(tmp_path: Path) -> None:
    """A forked rank is a copy of this process: PYTHONPATH (entries added to sys.path) and PYTHONWARNINGS
    (filters over the parent's) take effect; PYTHONHASHSEED, read only as Python starts, is refused, not ignored."""
    (tmp_path / "fork_given_path.py").write_text("VALUE = 'found'\n")
    env = {"PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": "error::UserWarning"}
    assert parallel(nprocs=1, start_method="fork", timeout=60, env=env)(workers.import_and_warn)() == [
        "found",
        "raised",
    ]
    with pytest.raises(InvalidOptionError, match=r"env sets PYTHONHASHSEED='1' \(rank 0\), which Python reads only"):
        parallel(nprocs=1, start_method="fork", timeout=60, env={"PYTHONHASHSEED": "1"})(workers.touch)("x")


def test_env_function_returning_a_reserved_variable_is_refused_before_any_worker(tmp_path: Path) -> None:
    marker = str(tmp_path / "started")
    touch = parallel(nprocs=2, start_method="fork", timeout=60)(workers.touch).options(
        env=lambda rank: {"WORLD_SIZE": "9"}
    )
    with pytest.raises(InvalidOptionError, match=r"env\(0\) sets WORLD_SIZE"):
        touch(marker)
    assert not os.path.exists(marker)


TEMPLATE = """
    import sys
    from mplaunch import parallel
    sys.path.insert(0, sys.argv[1])
    from tests import workers
    import os

    def pid_and_chat(lines):
        workers.chatty(lines)
        return os.getpid()

    if __name__ == "__main__":
        run = parallel(nprocs=2, start_method="fork", timeout=60, return_all=True,
                       prefix_output="{rank}|{pid} ")(pid_and_chat)
        print("pids", *run(2))
"""


def test_a_prefix_template_marks_every_line(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, TEMPLATE), str(REPO))
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    pids = next(line for line in out if line.startswith("pids")).split()[1:]
    for rank, pid in enumerate(pids):
        assert [line for line in out if line.startswith(f"{rank}|{pid} out")] == [
            f"{rank}|{pid} out {i} from {rank}" for i in range(2)
        ]
        assert f"{rank}|{pid} err from {rank}" in done.stderr.splitlines()


def test_debug_sets_env_for_rank_0_and_puts_the_environment_back() -> None:
    seen = parallel(nprocs=2, env=lambda rank: {"PLACEMENT_R": f"r{rank}"})(workers.placement_seen)
    assert seen.debug()["extra"] == {"PLACEMENT_R": "r0"}
    assert "PLACEMENT_R" not in os.environ


@pytest.mark.usefixtures("two_devices")
def test_devices_come_back_when_a_launch_fails_or_times_out(tmp_path: Path) -> None:
    from mplaunch import LaunchTimeoutError

    failing = parallel(nprocs=1, start_method="fork", timeout=60, devices=[1])(workers.raise_value_error)
    with pytest.raises(ValueError):
        failing.options(nprocs=2)()
    assert devices.pool().busy() == set()
    stuck = parallel(start_method="fork", timeout=1, devices=2)(workers.device_trial)  # never released
    with pytest.raises(LaunchTimeoutError):
        stuck(str(tmp_path), "stuck")
    assert devices.pool().busy() == set()


@pytest.mark.cuda
def test_a_real_device_is_the_ranks_only_one() -> None:
    import torch

    last = torch.cuda.device_count() - 1
    seen = parallel(start_method="spawn", timeout=120, return_all=True, devices=[last])(workers.cuda_seen)()
    names = devices.visible_names()
    assert seen == [(names[last], 1)]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_c_code_and_programs_see_the_ranks_environment_as_python_does(
    start_method: StartMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked rank's environment is made by the parent before the fork (one table for the C library, one
    mapping for ``os.environ``): C code (``getenv``, NCCL reads its variables so) and programs the rank runs
    see what Python sees, a variable the parent set with ``os.putenv`` alone stays, and a stale rank
    variable is gone from both; the rank's own changes reach both."""
    monkeypatch.setenv("GROUP_RANK", "3")  # stale: the worker's is 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "7")
    os.putenv("ONLY_IN_C", "c")  # os.environ does not know it
    before = dict(os.environ)
    try:
        run = parallel(nprocs=2, start_method=start_method, timeout=120, return_all=True)(workers.environments_seen)
        results = run.options(env=lambda rank: {"PLACEMENT_A": "a", f"PLACEMENT_R{rank}": str(rank)})()
    finally:
        os.unsetenv("ONLY_IN_C")
    assert dict(os.environ) == before
    for rank, result in enumerate(results):
        first, after = result["first"], result["after"]
        assert first["python"]["RANK"] == str(rank) and first["python"]["GROUP_RANK"] == "0"
        assert first["python"]["PLACEMENT_A"] == "a" and first["python"]["OMP_NUM_THREADS"] == "1"
        assert {k: v for k, v in first["exec"].items() if k.startswith("PLACEMENT_R")} == {
            f"PLACEMENT_R{rank}": str(rank)
        }
        assert first["python"]["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert first["c"] == first["python"] == first["bytes"]
        assert {k: v for k, v in first["exec"].items() if k in first["python"]} == first["python"]
        assert first["exec"]["ONLY_IN_C"] == "c"
        assert after["python"]["SET_IN_RANK"] == after["exec"]["SET_IN_RANK"] == after["bytes"]["SET_IN_RANK"] == "1"
        assert "OMP_NUM_THREADS" not in after["python"] and "OMP_NUM_THREADS" not in after["exec"]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_pythonbreakpoint_given_through_env_decides_the_ranks_breakpoint(start_method: StartMethod) -> None:
    """``env={"PYTHONBREAKPOINT": "0"}`` leaves a rank Python's own hook (which then does nothing), under
    every start method; without it, the rank has mplaunch's (pdb on the terminal, one rank at a time)."""
    run = parallel(nprocs=2, start_method=start_method, timeout=120, return_all=True)(
        workers.breakpoint_hook_is_pythons
    )
    assert run.options(env={"PYTHONBREAKPOINT": "0"})() == [True, True]
    assert run() == [False, False]


def test_pythonbreakpoint_set_for_c_code_alone_decides_a_forked_ranks_breakpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``os.putenv("PYTHONBREAKPOINT", "0")`` (not in ``os.environ``) turns ``breakpoint()`` off for CPython,
    which reads the C library's table; a forked rank took mplaunch's hook, as ``os.environ`` has no value."""
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    run = parallel(nprocs=1, start_method="fork", timeout=120)(workers.breakpoint_hook_is_pythons)
    os.putenv("PYTHONBREAKPOINT", "0")
    try:
        assert run() is True
    finally:
        os.unsetenv("PYTHONBREAKPOINT")
    assert run() is False
