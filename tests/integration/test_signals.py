"""Signals to the launching process (issue 21): SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 reach the ranks, as
torchrun forwards them, and end the launch as SIGTERM does; a parent that ignores SIGCHLD still reads every
exit status."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, assert_gone, run_script, write_script

FORWARDED = """
    import os, signal, sys, time
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method=sys.argv[1], timeout=60, grace_period=float(sys.argv[4]))
    def work(marks: str, own_handler: bool) -> None:
        rank = worker_info().rank
        if own_handler:  # the rank's own handler: it notes the signal and carries on
            def note(signum, frame):
                with open(os.path.join(marks, f"handled{rank}"), "w") as file:
                    file.write(signal.Signals(signum).name)
            signal.signal(signal.SIGUSR1, note)
        try:
            with open(os.path.join(marks, f"tmp{rank}"), "w") as file:
                file.write(str(os.getpid()))
            os.rename(os.path.join(marks, f"tmp{rank}"), os.path.join(marks, str(rank)))
            while True:
                time.sleep(0.05)
        finally:
            with open(os.path.join(marks, f"finally{rank}"), "w") as file:
                file.write("ran")

    if __name__ == "__main__":
        marks, parent_handler = sys.argv[2], sys.argv[3] == "parent-handler"
        if parent_handler:
            def handler(signum, frame):  # runs once the workers have been stopped
                stopped = all(os.path.exists(os.path.join(marks, f"finally{r}")) for r in (0, 1))
                print("parent handler:", signal.Signals(signum).name, "workers stopped first:", stopped, flush=True)
            for signum in (signal.SIGHUP, signal.SIGUSR1):
                signal.signal(signum, handler)
        try:
            work(marks, sys.argv[5] == "own")
        except KeyboardInterrupt as error:
            same = parent_handler and all(signal.getsignal(s) is handler for s in (signal.SIGHUP, signal.SIGUSR1))
            print("KeyboardInterrupt:", error, "handlers restored:", same, flush=True)
"""


def start(
    tmp_path: Path, start_method: str, parent: str, grace: float, ranks: str
) -> tuple[subprocess.Popen[str], list[int]]:
    """Start the script and wait until both ranks run (their pid files appear)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = write_script(tmp_path, FORWARDED)
    process = subprocess.Popen(
        [sys.executable, str(script), start_method, str(marks), parent, str(grace), ranks],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 60
    while not all((marks / rank).exists() for rank in "01"):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    return process, [int((marks / rank).read_text()) for rank in "01"]


def ended(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Wait for the script to end; kill it and everything it started if it does not within 60 s."""
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the script did not end: {out}{err}") from None


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_sighup_to_the_parent_runs_the_ranks_finally_blocks(tmp_path: Path, start_method: str) -> None:
    """A closed SSH session: the parent dies by SIGHUP, as without mplaunch, after the ranks unwound (their
    ``finally`` blocks ran); nothing is left. Before: the ranks died with the parent, no ``finally``."""
    process, pids = start(tmp_path, start_method, "default", 5.0, "plain")
    process.send_signal(signal.SIGHUP)
    out, err = ended(process)
    assert process.returncode == -signal.SIGHUP, err
    assert all((tmp_path / "marks" / f"finally{rank}").exists() for rank in "01"), err
    assert "Traceback" not in err, err
    assert_gone(pids, within=1.0)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"mplaunch-{process.pid}-")]


def test_sigusr1_reaches_a_ranks_own_handler(tmp_path: Path) -> None:
    """A rank's SIGUSR1 handler runs (a checkpoint on preemption); the rank carries on, so it is killed after
    the grace period, and the parent dies by SIGUSR1."""
    process, pids = start(tmp_path, "fork", "default", 1.0, "own")
    process.send_signal(signal.SIGUSR1)
    out, err = ended(process)
    assert process.returncode == -signal.SIGUSR1, err
    assert [(tmp_path / "marks" / f"handled{rank}").read_text() for rank in "01"] == ["SIGUSR1"] * 2
    assert_gone(pids, within=1.0)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1], ids=["SIGHUP", "SIGUSR1"])
def test_the_parents_own_handler_runs_after_the_workers_stopped(tmp_path: Path, signum: int) -> None:
    process, pids = start(tmp_path, "fork", "parent-handler", 5.0, "plain")
    process.send_signal(signum)
    out, err = ended(process)
    name = signal.Signals(signum).name
    assert f"parent handler: {name} workers stopped first: True" in out, err
    assert f"KeyboardInterrupt: {name} received during a launch handlers restored: True" in out, err
    assert process.returncode == 0 and "Traceback" not in err, err
    assert_gone(pids, within=1.0)


IGNORED_SIGCHLD = """
    import os, signal, sys, time
    from mplaunch import WorkerExitedError, parallel, worker_info

    @parallel(nprocs=2, start_method=sys.argv[1], timeout=60)
    def work(kill: bool) -> int:
        if kill and worker_info().rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return worker_info().rank

    if __name__ == "__main__":
        usual = 0.0
        if sys.argv[1] != "spawn":  # (a spawn launch is not timed: see the test)
            work(False)  # warm: imports, the fork server
            start = time.monotonic()
            work(False)
            usual = time.monotonic() - start
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # as some service managers start a process
        start = time.monotonic()
        assert work(False) == 0
        ignored = time.monotonic() - start
        try:
            work(True)
        except WorkerExitedError as error:
            print("killed:", error.rank, error.signal_name, error.exitcode, flush=True)
        print("slower by", round(ignored - usual, 2), flush=True)
        print("restored:", signal.getsignal(signal.SIGCHLD) is signal.SIG_IGN, flush=True)
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_a_parent_that_ignores_sigchld_reads_every_exit(tmp_path: Path, start_method: str) -> None:
    """With SIGCHLD ignored the kernel reaps ended children at once: a launch took 5 s longer and a SIGKILLed
    rank was 'exit code None'."""
    done = run_script(write_script(tmp_path, IGNORED_SIGCHLD), start_method)
    assert done.returncode == 0, done.stderr
    assert "killed: 1 SIGKILL -9" in done.stdout, done.stdout + done.stderr
    if start_method != "spawn":  # a spawn launch takes seconds on a busy machine: too noisy to time (nor timed)
        assert float(done.stdout.split("slower by ")[1].split()[0]) < 1.0, done.stdout
    assert "restored: True" in done.stdout, done.stdout


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_signal_the_caller_ignores_is_ignored_by_its_ranks(start_method: str) -> None:
    """Under ``nohup`` (SIGHUP ignored) a hangup must not end the ranks, whatever their start method: a
    forkserver worker inherits the fork server's dispositions, not the caller's."""
    from mplaunch import parallel
    from tests import workers

    multiprocessing.forkserver.ensure_running()  # started with SIGHUP at its default
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        run = parallel(nprocs=2, start_method=start_method, timeout=60)(workers.signal_self)  # type: ignore[call-overload]
        assert run(signal.SIGHUP) == 0
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_signal_that_lands_while_workers_fork_ends_the_launch_after_the_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGUSR1 that another thread receives while the workers fork: the main thread's handler runs during
    the forks, where it only notes the signal; when the forks are done, it ends the launch (the workers are
    stopped with it), then the caller's handler runs and the call raises ``KeyboardInterrupt``."""
    import threading

    from mplaunch import parallel
    from tests import workers
    from tests.helpers import fork_with

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's")
    called: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: called.append(signum))
    other = threading.Event()
    receiver = threading.Thread(target=other.wait, daemon=True)  # SIGUSR1 is blocked in the forking thread
    receiver.start()

    def before(pids: list[int]) -> None:
        if not pids:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)  # the receiver takes it; the main thread's handler runs in the next lines

    pids = fork_with(monkeypatch, before)
    try:
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="SIGUSR1 received during a launch"):
            parallel(nprocs=2, start_method="fork", timeout=60)(workers.sleep)(30.0)
        assert time.monotonic() - started < 20
    finally:
        other.set()
        signal.signal(signal.SIGUSR1, previous)
    assert called == [signal.SIGUSR1]
    assert len(pids) == 2
    assert_gone(pids, within=1.0)


def test_sigterm_to_a_rank_stops_the_launch_it_made() -> None:
    """A rank that launches fork workers of its own gets SIGTERM: its launch stops its workers and raises at
    once. Its workers had inherited the rank's state from while it forked them, and a SIGTERM noted there
    was never raised again: the nested launch ran its 30 s."""
    from mplaunch import parallel
    from tests import workers

    name, seconds = parallel(nprocs=1, start_method="fork", timeout=90)(workers.nested_launch_stopped_by_sigterm)()
    assert name == "Terminated" and seconds < 15, (name, seconds)


OFF_THE_MAIN_THREAD = """
    import concurrent.futures, os, signal, sys, threading, time
    from mplaunch import parallel, worker_info

    def work(marks: str) -> int:
        rank = worker_info().rank
        with open(os.path.join(marks, f"tmp{rank}"), "w") as file:
            file.write(str(os.getpid()))
        os.rename(os.path.join(marks, f"tmp{rank}"), os.path.join(marks, str(rank)))
        while not os.path.exists(os.path.join(marks, "go")):
            time.sleep(0.05)
        return rank + 7

    def run(future, function, marks):
        try:
            future.set_result(function(marks))
        except BaseException as error:
            future.set_exception(error)

    if __name__ == "__main__":
        how, start_method, marks, target = sys.argv[1:]
        function = parallel(nprocs=2, start_method=start_method, timeout=30)(work)
        if how == "submit":
            future = function.submit(marks)
        else:  # a thread of the caller's own, as a server's worker thread
            future = concurrent.futures.Future()
            threading.Thread(target=lambda: run(future, function, marks), daemon=True).start()
        while not all(os.path.exists(os.path.join(marks, rank)) for rank in "01"):
            time.sleep(0.02)
        pid = int(open(os.path.join(marks, "1")).read())
        sent = time.monotonic()
        if target == "rank":
            os.kill(pid, signal.SIGINT)
        else:  # as a notebook's interrupt: SIGINT to the caller's whole process group, which the kernel handles
            signal.signal(signal.SIGINT, lambda signum, frame: print("caller interrupted", flush=True))
            os.killpg(os.getpgrp(), signal.SIGINT)
            time.sleep(1.0)  # time for the ranks to die of it
            open(os.path.join(marks, "go"), "w").close()
        try:
            print("RESULT", future.result(), flush=True)
        except BaseException as error:
            print("RAISED", type(error).__name__, getattr(error, "signal_name", None), flush=True)
        print("TOOK", time.monotonic() - sent, flush=True)
"""


@pytest.mark.parametrize(
    ("how", "start_method", "target"),
    [
        ("thread", "fork", "rank"),
        ("submit", "fork", "rank"),
        pytest.param("thread", "spawn", "rank", marks=pytest.mark.slow),
        ("submit", "forkserver", "rank"),
        ("submit", "fork", "group"),
        pytest.param("thread", "forkserver", "group", marks=pytest.mark.slow),
    ],
)
def test_sigint_to_a_rank_of_a_launch_off_the_main_thread_ends_it(
    tmp_path: Path, how: str, start_method: str, target: str
) -> None:
    """Issue 37, item 10(c): the ranks of a launch made off the main thread (``submit()``, a server's thread)
    ignored SIGINT, so that a Ctrl-C to the caller's group is the main thread's to decide: one sent to a rank
    was lost and the launch ran to its timeout. With no controlling terminal (a kernel, a service: here a new
    session) each rank takes a process group of its own: a SIGINT to a rank ends the call as from the main
    thread, and one to the caller's group (a notebook's interrupt) leaves the launch running to its result."""
    marks = tmp_path / "marks"
    marks.mkdir()
    done = subprocess.run(
        [sys.executable, str(write_script(tmp_path, OFF_THE_MAIN_THREAD)), how, start_method, str(marks), target],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,  # no controlling terminal, wherever the tests run
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if target == "rank":
        assert "RAISED WorkerExitedError SIGINT" in done.stdout, done.stdout + done.stderr
        assert float(done.stdout.split("TOOK ")[1]) < 10, done.stdout  # not the launch's timeout of 30 s
    else:
        assert "caller interrupted" in done.stdout, done.stdout
        assert "RESULT 7" in done.stdout, done.stdout + done.stderr
