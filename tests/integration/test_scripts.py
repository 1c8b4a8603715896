"""Launches from real scripts in a subprocess: the main guard, __main__ classes, and signals to the parent."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_gone, run_script, write_script

Starter = Callable[..., "tuple[subprocess.Popen[str], list[int]]"]


GUARDED = """
    import dataclasses, os, sys
    import torch
    from mplaunch import parallel, worker_info

    @dataclasses.dataclass
    class Result:
        rank: int
        weights: torch.Tensor

    @parallel(nprocs=2, start_method=sys.argv[1], timeout=60)
    def train(scale: float) -> Result:
        print(f"worker {worker_info().rank}", flush=True)
        return Result(worker_info().rank, torch.ones(3) * scale)

    if __name__ == "__main__":
        result = train(2.0)
        print("isinstance", isinstance(result, Result), result.rank, result.weights.tolist())
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_main_script_function_and_class_travel_by_reference(tmp_path: Path, start_method: str) -> None:
    done = run_script(write_script(tmp_path, GUARDED), start_method)
    assert done.returncode == 0, done.stderr
    assert "isinstance True 0 [2.0, 2.0, 2.0]" in done.stdout
    assert sorted(re.findall(r"worker \d", done.stdout)) == ["worker 0", "worker 1"]  # the two may interleave


UNGUARDED = """
    import sys
    from mplaunch import parallel

    @parallel(nprocs=2, start_method=sys.argv[1])
    def work() -> int:
        print("worker ran", flush=True)
        return 1

    work()
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_missing_main_guard_is_refused_in_the_parent(tmp_path: Path, start_method: str) -> None:
    start = time.monotonic()
    done = run_script(write_script(tmp_path, UNGUARDED), start_method)
    assert done.returncode == 1
    assert "LaunchRefusedError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "script.py (line 10)" in done.stderr
    assert "worker ran" not in done.stdout
    assert time.monotonic() - start < 30


SIGNALLED = """
    import os, signal, sys, time
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method=sys.argv[1], grace_period=2.0)
    def work(pid_dir: str) -> None:
        rank = str(worker_info().rank)
        with open(os.path.join(pid_dir, "tmp" + rank), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, "tmp" + rank), os.path.join(pid_dir, rank))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                time.sleep(0.1)
            except KeyboardInterrupt:
                if worker_info().rank == 1:  # stubborn: keeps running until SIGKILL
                    continue
                raise

    if __name__ == "__main__":
        handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        try:
            work(sys.argv[2])
        except KeyboardInterrupt:
            same = handlers == (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
            print("interrupted; handlers restored:", same, flush=True)
"""


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Starter]:
    """Start a script's parent process and wait until both workers wrote their pids (and any children's)."""
    parents: list[subprocess.Popen[str]] = []

    def start(body: str, start_method: str, new_session: bool = False) -> tuple[subprocess.Popen[str], list[int]]:
        pid_dir = tmp_path / "pids"
        pid_dir.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        parent = subprocess.Popen(
            [sys.executable, str(write_script(tmp_path, body)), start_method, str(pid_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=new_session,
        )
        parents.append(parent)
        deadline = time.monotonic() + 60
        while len(list(pid_dir.glob("[01]"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return parent, [int(pid) for name in ("0", "1") for pid in (pid_dir / name).read_text().split()]

    yield start
    for parent in parents:
        if parent.poll() is None:
            parent.kill()
        parent.communicate()


@pytest.mark.parametrize(
    ("start_method", "to_group"), [("fork", False), ("spawn", False), ("fork", True)], ids=["fork", "spawn", "ctrl-c"]
)
def test_sigint_stops_workers_and_restores_handlers(started: Starter, start_method: str, to_group: bool) -> None:
    """SIGINT to the parent alone, or to its whole process group as Ctrl-C in a terminal does."""
    parent, pids = started(SIGNALLED, start_method, to_group)
    if to_group:
        os.killpg(parent.pid, signal.SIGINT)
    else:
        parent.send_signal(signal.SIGINT)
    out, err = parent.communicate(timeout=30)
    assert "interrupted; handlers restored: True" in out, err
    assert_gone(pids, within=1.0)  # the stubborn rank was SIGKILLed after the 2 s grace period, before returning


def test_sigterm_to_the_parent_stops_workers_and_ends_it_by_sigterm(started: Starter) -> None:
    parent, pids = started(SIGNALLED, "fork")
    parent.send_signal(signal.SIGTERM)
    parent.communicate(timeout=30)
    assert parent.returncode == -signal.SIGTERM
    assert_gone(pids, within=1.0)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{parent.pid}-")]  # cleaned up first


def test_killing_the_parent_under_forkserver_takes_the_workers(started: Starter) -> None:
    parent, pids = started(SIGNALLED, "forkserver")
    parent.kill()
    parent.communicate(timeout=30)
    assert_gone(pids, within=15.0)


ORPHANED = """
    import os, sys, time
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset
    from mplaunch import parallel, worker_info

    class Slow(Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            time.sleep(0.2)
            return torch.tensor(i)

    @parallel(nprocs=2, start_method=sys.argv[1])
    def work(pid_dir: str) -> None:
        dist.init_process_group("gloo")
        rank = worker_info().rank
        if rank == 0:
            loader = iter(DataLoader(Slow(), num_workers=1))
            next(loader)
            import psutil
            pids = [os.getpid()] + [c.pid for c in psutil.Process().children()]
        else:
            pids = [os.getpid()]
        with open(os.path.join(pid_dir, "tmp"), "w") as f:
            f.write(" ".join(map(str, pids)))
        os.rename(os.path.join(pid_dir, "tmp"), os.path.join(pid_dir, str(rank)))
        while True:
            try:
                if rank == 1:
                    dist.barrier()  # blocked in a collective: rank 0 never joins
                else:
                    next(loader)
            except KeyboardInterrupt:
                pass

    if __name__ == "__main__":
        work(sys.argv[2])
"""


def test_killing_the_parent_takes_workers_and_their_children_with_it(started: Starter) -> None:
    parent, pids = started(ORPHANED, "fork")
    assert len(pids) >= 3  # two workers and at least one DataLoader worker
    parent.kill()
    parent.communicate(timeout=30)
    assert_gone(pids, within=15.0)


AFTER_MATMUL = """
    import warnings
    import torch
    from mplaunch import parallel

    @parallel(nprocs=1, start_method="fork", timeout=60)
    def work() -> int:
        x = torch.randn(10**6)
        assert torch.isfinite(x.exp().sum())
        assert torch.isfinite((torch.randn(600, 600) @ torch.randn(600, 600)).sum())
        return torch.get_num_threads()

    if __name__ == "__main__":
        torch.set_num_threads(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = []
            for _ in range(3):  # launch, then threads in the parent, then launch again (issue 10)
                threads.append(work())
                torch.randn(10**7).exp().sum()  # the parent's OpenMP pool is live now
                (torch.randn(800, 800) @ torch.randn(800, 800)).sum()
        print("threads", threads, "warned", [str(w.message) for w in caught])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for a worker to want 2 threads")
def test_fork_after_multithreaded_ops_neither_hangs_nor_loses_threads(tmp_path: Path) -> None:
    """Issue 10: after a launch, parallel ops in the parent, then a second launch hung until the timeout (GNU
    OpenMP's pool does not survive fork; the 1-thread fallback only looked before the first launch). The
    pool is released before every fork now, so each forked worker runs multi-threaded ops with 2 threads."""
    done = run_script(write_script(tmp_path, AFTER_MATMUL), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "threads [2, 2, 2] warned []" in done.stdout, done.stdout


MANY_LAUNCHES = """
    import os, sys, tempfile
    import psutil
    from mplaunch import parallel
    sys.path.insert(0, sys.argv[1])
    from tests import workers

    def counts():
        me = psutil.Process()
        shm = [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{os.getpid()}-")]
        return {"children": len(me.children(recursive=True)), "fds": me.num_fds(), "shm": len(shm),
                "tmp": len(os.listdir(tempfile.gettempdir()))}

    if __name__ == "__main__":
        calls = [
            (parallel(nprocs=2, start_method="fork", timeout=60)(workers.sleep), (0.0,), None),
            (parallel(nprocs=2, start_method="fork", timeout=60)(workers.raise_value_error), (), ValueError),
            (parallel(nprocs=2, start_method="fork", timeout=60)(workers.big_result), (1,), None),
            (parallel(nprocs=2, start_method="fork", timeout=60)(workers.kill_self), (9,), RuntimeError),
            (parallel(nprocs=2, start_method="forkserver", timeout=60)(workers.raise_everywhere), (), KeyError),
        ]
        try:
            calls[4][0]()
        except KeyError:
            pass  # warms up the fork server, which then stays (a child by design)
        before = counts()
        for i in range(200):
            function, args, expected = calls[i % len(calls)]
            try:
                function(*args)
            except Exception as error:
                assert expected is not None, repr(error)
                assert isinstance(error, expected), repr(error)
        after = counts()
        print("before", before)
        print("after", after)
        print("same", before == after)
"""


@pytest.mark.slow
def test_two_hundred_launches_leave_nothing_behind(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    done = run_script(write_script(tmp_path, MANY_LAUNCHES), str(REPO), timeout=600, tmpdir=tmpdir)
    assert done.returncode == 0, done.stderr
    assert "same True" in done.stdout, done.stdout
    assert "resource_tracker" not in done.stderr, done.stderr
    assert "leaked" not in done.stderr, done.stderr


UNDER_TORCHRUN = """
    import torch.distributed as dist
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method="spawn", backend="gloo", timeout=60)
    def work() -> tuple[int, int, int]:
        value = torch_sum()
        return worker_info().rank, dist.get_world_size(), value

    def torch_sum() -> int:
        import torch
        t = torch.tensor([dist.get_rank() + 1])
        dist.all_reduce(t)
        return int(t.item())

    if __name__ == "__main__":
        rank, world, total = work()
        print(f"rank {rank} of {world}: total {total}")
"""


def test_under_torchrun_the_call_runs_in_process_as_that_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, UNDER_TORCHRUN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"--log-dir={tmp_path / 'logs'}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(re.findall(r"rank \d+ of \d+: total \d+", done.stdout))  # the two ranks' lines may interleave
    assert lines == ["rank 0 of 2: total 3", "rank 1 of 2: total 3"]  # 2 ranks in all: nothing nested


CONCURRENT = """
    import sys
    from mplaunch import parallel
    sys.path.insert(0, sys.argv[1])
    from tests import workers

    if __name__ == "__main__":
        run = parallel(nprocs=2, start_method="fork", backend="gloo", return_all=True, timeout=60)
        print("results", [run(workers.all_reduce_in_given_group)() for _ in range(3)])
"""


def test_concurrent_launches_with_process_groups_never_collide(tmp_path: Path) -> None:
    script = write_script(tmp_path, CONCURRENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parents = [
        subprocess.Popen(
            [sys.executable, str(script), str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [parent.communicate(timeout=120) for parent in parents]
    for parent, (out, err) in zip(parents, outputs, strict=True):
        assert parent.returncode == 0, err
        assert out.strip() == "results " + str([[(2, 3.0), (2, 3.0)]] * 3)


MANY_TENSORS = """
    import resource, sys
    import torch
    from mplaunch import parallel

    @parallel(nprocs=2, start_method=sys.argv[1], timeout=120)
    def total(module: torch.nn.Module, tensors: list) -> float:
        return sum(float(t.sum()) for t in tensors) + sum(float(p.sum()) for p in module.parameters())

    if __name__ == "__main__":
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        module = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(150)])  # 300 parameters
        torch.nn.init.ones_(module[0].weight)
        tensors = [torch.ones(32 * 1024) for _ in range(300)]  # 128 KiB each: every one in a file of its own
        expected = sum(float(t.sum()) for t in tensors) + sum(float(p.sum()) for p in module.parameters())
        print("same", total(module, tensors) == expected)
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_many_tensor_arguments_fit_a_small_open_file_limit(tmp_path: Path, start_method: str) -> None:
    done = run_script(write_script(tmp_path, MANY_TENSORS), start_method)
    assert done.returncode == 0, done.stderr
    assert "same True" in done.stdout


DEFINED_IN_GUARD = """
    import sys
    from mplaunch import parallel

    if __name__ == "__main__":
        @parallel(nprocs=1, start_method=sys.argv[1], timeout=60)
        def inside(x: int) -> int:
            return x + 1

        print("result", inside(1))
"""


def test_a_function_defined_inside_the_guard_is_sent_by_value(tmp_path: Path) -> None:
    done = run_script(write_script(tmp_path, DEFINED_IN_GUARD), "forkserver")
    assert done.returncode == 0, done.stderr
    assert "result 2" in done.stdout


BIG_ARGUMENT = """
    import os, sys, time
    import torch
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method=sys.argv[1])
    def work(pid_dir: str, weights: torch.Tensor) -> None:
        rank = str(worker_info().rank)
        with open(os.path.join(pid_dir, "tmp" + rank), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, "tmp" + rank), os.path.join(pid_dir, rank))
        time.sleep(120)

    if __name__ == "__main__":
        work(sys.argv[2], torch.ones(64 * 2**20))  # 256 MiB of shared memory for the whole call
"""


def _memory_files(pids: list[int], at_least: int) -> set[int]:
    """The inodes of mplaunch's memory files (memfd) of ``at_least`` bytes or more that ``pids`` hold open or
    mapped."""
    found: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    path = f"/proc/{pid}/fd/{fd}"
                    if os.readlink(path).startswith("/memfd:mplaunch-") and os.stat(path).st_size >= at_least:
                        found.add(os.stat(path).st_ino)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/memfd:mplaunch-"):
                    start, end = (int(bound, 16) for bound in fields[0].split("-"))
                    if end - start >= at_least:
                        found.add(int(fields[4]))
    return found


def _holders(inodes: set[int]) -> list[int]:
    """The processes of the machine that still hold a memory file of ``inodes`` open or mapped."""
    every = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return [pid for pid in every if pid != os.getpid() and _memory_files([pid], 0) & inodes]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP])
def test_a_killed_parents_launch_directory_is_removed_without_a_later_launch(started: Starter, signum: int) -> None:
    """Issue 16: after SIGKILL (or SIGHUP, SIGQUIT) the launch directory stayed in /dev/shm until some later
    launch cleaned it: a dead job's arguments and results could hold gigabytes of RAM. The parent's reaper
    removes it as soon as the parent is gone, and the memory files of the call go with the last process that
    holds them (checked by who holds them: the machine's shared memory in use moved with the tests beside it)."""
    parent, pids = started(BIG_ARGUMENT, "forkserver")
    argument = _memory_files([parent.pid, *pids], 200 * 2**20)
    assert argument  # the 256 MiB argument, in a memory file the call made
    assert set(_holders(argument)) >= set(pids)  # (each worker maps it: the look finds holders)
    parent.send_signal(signum)
    parent.communicate(timeout=30)
    assert_gone(pids, within=15.0)
    deadline = time.monotonic() + 10
    while [
        e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{parent.pid}-")
    ] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{parent.pid}-")]
    while (holders := _holders(argument)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not holders  # no process holds the argument: its memory is free


QUIET_STOP = """
    import sys
    sys.path.insert(0, sys.argv[3])
    from mplaunch import LaunchTimeoutError, parallel
    from tests import workers

    @parallel(nprocs=2, start_method=sys.argv[1], timeout=float(sys.argv[4]), grace_period=3.0)
    def work(ready_dir: str, fail: bool) -> None:
        workers.dataloader_forever(ready_dir, fail)

    if __name__ == "__main__":
        try:
            work(sys.argv[2], sys.argv[5] == "fail")
        except (LaunchTimeoutError, RuntimeError, KeyboardInterrupt) as error:
            print("stopped by", type(error).__name__, flush=True)
"""


@pytest.mark.parametrize(
    ("start_method", "how"), [("fork", "timeout"), ("spawn", "peer"), ("fork", "ctrl-c"), ("forkserver", "peer")]
)
def test_a_stop_the_user_asked_for_is_quiet(tmp_path: Path, start_method: str, how: str) -> None:
    """Issue 10/16: a stop (timeout, a peer's failure, Ctrl-C) printed tracebacks from the ranks' own
    DataLoader workers and exit handlers. Ranks iterate a DataLoader with 2 persistent workers when stopped."""
    ready_dir = tmp_path / "ready"
    ready_dir.mkdir()
    timeout, fail = {"timeout": ("4", "no"), "peer": ("120", "fail"), "ctrl-c": ("120", "no")}[how]
    parent = subprocess.Popen(
        [
            sys.executable,
            str(write_script(tmp_path, QUIET_STOP)),
            start_method,
            str(ready_dir),
            str(REPO),
            timeout,
            fail,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        if how == "ctrl-c":
            deadline = time.monotonic() + 60
            while len(list(ready_dir.glob("ready-[01]"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # both ranks iterate their DataLoader, whose workers run
            os.killpg(parent.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the parent's whole process group
        out, err = parent.communicate(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
    expected = {"timeout": "LaunchTimeoutError", "peer": "RuntimeError", "ctrl-c": "KeyboardInterrupt"}[how]
    assert f"stopped by {expected}" in out, (out, err)
    assert "Traceback" not in err, err
    assert "Exception ignored" not in err, err
