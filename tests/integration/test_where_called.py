"""Calls from where other libraries run code (issue 21, item 6): a daemonic ``multiprocessing.Pool`` worker,
and a decorated function that another runner pickles into a fresh interpreter."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests import compat_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(("pool_method", "start_method"), [("fork", "fork"), ("fork", "spawn"), ("spawn", "fork")])
def test_a_daemonic_pool_worker_can_launch(pool_method: str, start_method: str) -> None:
    pool = multiprocessing.get_context(pool_method).Pool(1)
    try:
        worker, pool_worker, daemonic = pool.apply(compat_workers.launch_from_pool_worker, (start_method,))
    finally:
        pool.terminate()
        pool.join()
    assert daemonic and worker not in (pool_worker, os.getpid())


def test_a_process_pool_executor_runs_a_module_level_decorated_function() -> None:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as executor:
        assert executor.submit(compat_workers.double_in_a_rank, 21).result(timeout=120) == (42, 0)


SCRIPT = textwrap.dedent(
    """
    import os, pickle, subprocess, sys
    import cloudpickle
    from mplaunch import parallel

    @parallel(nprocs=1, start_method="fork", timeout=60)
    def train(x):
        return x * 2, os.environ["RANK"], os.getpid()

    if __name__ == "__main__":
        load = "import pickle, sys; fn = pickle.loads(sys.stdin.buffer.read()); print(fn(21)[:2])"
        done = subprocess.run([sys.executable, "-c", load], input=cloudpickle.dumps(train), capture_output=True,
                              timeout=100)
        sys.stdout.write(done.stdout.decode() + done.stderr.decode()[-2000:])
        sys.exit(done.returncode)
    """
)


def test_a_main_function_pickled_by_cloudpickle_loads_in_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "search.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "(42, '0')"


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_terminated_pool_leaves_no_worker_behind(start_method: str, tmp_path: Path) -> None:
    path = tmp_path / "started"
    if start_method == "forkserver":  # the pool worker inherits this process's fork server, not its own
        multiprocessing.forkserver.ensure_running()
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        launched = pool.apply_async(compat_workers.launch_sleeper, (str(path), start_method))
        deadline = time.monotonic() + 60
        while not path.exists() or not path.read_text():  # the rank runs: wait for its file, not for a time
            if launched.ready():
                launched.get()  # the launch failed: raise why
            assert time.monotonic() < deadline
            time.sleep(0.01)
        worker = int(path.read_text())
    finally:
        pool.terminate()  # SIGTERM to the daemonic pool worker, which exits at once
        pool.join()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the rank outlived the pool worker that launched it"
        time.sleep(0.01)


IN_LOKY = textwrap.dedent(
    """
    import sys
    from joblib import Parallel, delayed
    import mplaunch
    from mplaunch import parallel, worker_info

    @parallel(nprocs=2, start_method="spawn", timeout=90, return_all=True)
    def train(x):
        return x * 10 + worker_info().rank

    def count(n):
        yield from range(n)

    def job(start_method):
        if start_method == "warm":
            with mplaunch.Workers(nprocs=2, start_method="spawn", timeout=90) as workers:
                return workers.run(train, 1), list(workers.run(count, 2))
        return train.options(start_method=start_method)(1)

    if __name__ == "__main__":
        print(Parallel(n_jobs=2, backend="loky")(delayed(job)(how) for how in sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_a_decorated_function_launches_from_a_joblib_loky_worker(tmp_path: Path) -> None:
    """A loky worker's multiprocessing start method is loky's own, which a spawned rank cannot set (it died in
    multiprocessing's start-up: "exited with code 1 before returning"), and its ``__main__`` is loky's module,
    not the script: the rank finds the function all the same, under every start method and in warm ranks."""
    script = tmp_path / "search.py"
    script.write_text(IN_LOKY)
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, str(script), "spawn", "forkserver", "fork", "warm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip() == "[[10, 11], [10, 11], [10, 11], ([10, 11], [0, 1])]"
