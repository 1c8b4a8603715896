"""A rank in an interactive shell (issue 21): it reads and configures the caller's terminal as a process of
raw ``torch.multiprocessing`` does, and a terminal's Ctrl-C ends the call cleanly. Each script runs in a real
pseudo-terminal (pexpect), where it is the terminal's foreground job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pexpect  # type: ignore[import-untyped]
import psutil
import pytest

from tests.helpers import REPO, assert_gone

METHODS = ["fork", "spawn", "forkserver"]

SCRIPT = """
    import os, subprocess, sys, time
    from mplaunch import parallel, worker_info

    def ask() -> str | None:
        return input("give: ") if worker_info().rank == 0 else None

    def debug() -> int:
        value = 41
        if worker_info().rank == 0:
            breakpoint()
            value += 1
        return value

    def debug_both() -> int:
        rank = worker_info().rank
        breakpoint()
        return rank

    def debug_distributed() -> int:
        import torch.distributed as dist
        value = 41
        dist.breakpoint(rank=0)  # rank 0 reads the terminal (/dev/stdin), the others wait in a barrier
        return value + 1

    def configure() -> str:
        import readline, termios
        attributes = termios.tcgetattr(0)
        termios.tcsetattr(0, termios.TCSANOW, attributes)  # a background process would get SIGTTOU here
        return "configured"

    def run_until_stopped(pid_dir: str) -> None:
        child = subprocess.Popen(["sleep", "100"])
        rank = str(worker_info().rank)
        with open(os.path.join(pid_dir, "tmp" + rank), "w") as file:
            file.write(f"{os.getpid()} {child.pid}")
        os.rename(os.path.join(pid_dir, "tmp" + rank), os.path.join(pid_dir, rank))
        print(f"started {rank}", flush=True)  # one write: with PYTHONUNBUFFERED, print's pieces are several
        while True:
            time.sleep(0.1)

    if __name__ == "__main__":
        mode, start_method = sys.argv[1], sys.argv[2]
        backend = sys.argv[3] if mode == "debug_distributed" else None
        options = dict(nprocs=2, start_method=start_method, timeout=90, grace_period=2.0, backend=backend)
        function = parallel(**options)(globals()[mode])
        arguments = sys.argv[3 + (backend is not None) :]
        try:
            if os.environ.get("SUBMIT"):  # from a thread of the launch's own, waited on by the main thread
                print("RESULT", function.submit(*arguments).result(), flush=True)
            else:
                print("RESULT", function(*arguments), flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
"""


Terminal = Callable[..., pexpect.spawn]


@pytest.fixture
def in_terminal(tmp_path: Path) -> Iterator[Terminal]:
    """Run the script with ``args`` in a new pseudo-terminal; kill what is left of it after the test."""
    terminals: list[pexpect.spawn] = []

    def start(*args: str, submit: bool = False, body: str = SCRIPT) -> pexpect.spawn:
        script = tmp_path / "script.py"
        script.write_text(textwrap.dedent(body))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("PYTHONBREAKPOINT", None)
        if submit:
            env["SUBMIT"] = "1"
        terminal = pexpect.spawn(
            sys.executable, [str(script), *args], env=env, cwd=str(tmp_path), timeout=60, encoding="utf-8"
        )
        terminals.append(terminal)
        return terminal

    yield start
    for terminal in terminals:
        if terminal.isalive():
            for child in psutil.Process(terminal.pid).children(recursive=True):
                child.kill()  # stopped by the terminal (SIGTTIN/SIGTTOU) or stuck: not waited for
            terminal.close(force=True)


def finish(terminal: pexpect.spawn) -> str:
    """Wait for the script to end; return what it printed since the last expectation."""
    terminal.expect(pexpect.EOF)
    terminal.close()
    output: str = terminal.before
    assert terminal.exitstatus == 0, output
    return output


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_reads_the_terminal_with_input(in_terminal: Terminal, start_method: str) -> None:
    """The rank's stdin was /dev/null (EOFError); in a group of its own, a terminal read would stop it."""
    terminal = in_terminal("ask", start_method)
    terminal.expect_exact("give: ")
    terminal.sendline("hello")
    terminal.expect_exact("RESULT hello")
    finish(terminal)


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_stops_at_a_breakpoint(in_terminal: Terminal, start_method: str) -> None:
    """The prompt names the rank (issue 24); ``p`` reads the rank's own state; ``c`` returns normally."""
    terminal = in_terminal("debug", start_method)
    terminal.expect_exact("(Pdb rank 0) ")
    terminal.sendline("p worker_info().rank, value")
    terminal.expect_exact("(0, 41)")
    terminal.expect_exact("(Pdb rank 0) ")
    terminal.sendline("c")
    terminal.expect_exact("RESULT 42")
    finish(terminal)


def test_ranks_debug_one_at_a_time_and_quitting_fails_the_rank(in_terminal: Terminal) -> None:
    """Both ranks reach breakpoint(): the second prompt appears only once the first rank continues. ``q`` in
    the second raises BdbQuit there, which is that rank's failure, as in a plain process."""
    terminal = in_terminal("debug_both", "fork")
    terminal.expect(r"\(Pdb rank (\d)\) ")
    first = int(terminal.match.group(1))
    terminal.sendline("p worker_info().rank")
    terminal.expect_exact(f"(Pdb rank {first}) ")
    assert "(Pdb rank" not in terminal.before  # the other rank waits for the terminal
    assert str(first) in terminal.before
    terminal.sendline("c")
    terminal.expect_exact(f"(Pdb rank {1 - first}) ")
    terminal.sendline("q")
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert "BdbQuit" in terminal.before
    assert terminal.exitstatus == 1


def test_a_breakpoint_without_a_terminal_says_so_and_goes_on(tmp_path: Path) -> None:
    """A rank whose stdin is no terminal (a notebook kernel's, a pipe's) cannot debug: it says where to go
    (fn.debug()) and carries on, instead of pdb reading an empty stdin and raising BdbQuit."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONBREAKPOINT", None)
    done = subprocess.run(
        [sys.executable, str(script), "debug", "fork"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "RESULT 42" in done.stdout
    assert "breakpoint() in rank 0 skipped" in done.stderr
    assert "fn.debug(" in done.stderr


def test_torch_distributed_breakpoint(in_terminal: Terminal) -> None:
    """torch.distributed.breakpoint() opens /dev/stdin itself: only the process group matters, not the start
    method."""
    terminal = in_terminal("debug_distributed", "fork", "gloo")
    terminal.expect_exact("(Pdb)")
    terminal.sendline("p 1+1")
    terminal.expect_exact("2")
    terminal.expect_exact("(Pdb)")
    terminal.sendline("c")
    terminal.expect_exact("RESULT 42")
    finish(terminal)


@pytest.mark.parametrize("start_method", METHODS)
def test_a_rank_configures_the_terminal(in_terminal: Terminal, start_method: str) -> None:
    """tcsetattr from a background process group: SIGTTOU, and the call hung."""
    terminal = in_terminal("configure", start_method)
    terminal.expect_exact("RESULT configured")
    finish(terminal)


@pytest.mark.parametrize(("start_method", "submit"), [("fork", False), ("spawn", False), ("fork", True)])
def test_ctrl_c_in_the_terminal_ends_the_call_cleanly(
    in_terminal: Terminal, tmp_path: Path, start_method: str, submit: bool
) -> None:
    """The terminal's SIGINT reaches the parent and the ranks (one foreground job): KeyboardInterrupt in the
    parent, no traceback from a rank, no process left (the ranks' subprocesses included). A submitted launch's
    workers leave the Ctrl-C to the main thread, interrupted in ``result()``, which stops them."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    terminal = in_terminal("run_until_stopped", start_method, str(pid_dir), submit=submit)
    for _ in range(2):
        terminal.expect(r"started [01]")
    pids = [int(pid) for rank in ("0", "1") for pid in (pid_dir / rank).read_text().split()]
    assert all(psutil.pid_exists(pid) for pid in pids)
    terminal.sendintr()
    terminal.expect_exact("INTERRUPTED")
    output = terminal.before + finish(terminal)
    assert "Traceback" not in output and "Interrupted" not in output, output
    assert_gone(pids, within=1.0)


IMPORTING = """
    import sys, time
    import mplaunch
    from mplaunch import parallel

    if __name__ == "__mp_main__":  # a spawned rank runs the script again: slow, as importing torch can be
        print("importing", flush=True)
        time.sleep(60)

    def work() -> int:
        return 1

    if __name__ == "__main__":
        try:
            if sys.argv[1] == "warm":
                with mplaunch.Workers(nprocs=2, start_method="spawn", grace_period=60, rdzv_timeout=120) as workers:
                    workers.run(work)
            else:
                parallel(nprocs=2, start_method="spawn", timeout=120, grace_period=60)(work)()
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
"""


@pytest.mark.parametrize("how", ["call", "warm"])
def test_ctrl_c_while_spawned_ranks_import_ends_the_call_at_once_in_one_line(in_terminal: Terminal, how: str) -> None:
    """Spawned ranks still importing (here the script, for 60 s) are not set up yet. Each printed its import's
    ``KeyboardInterrupt`` traceback (multiprocessing's resource tracker, started with the first spawn, unblocked
    SIGINT), and a warm call waited for their answer. They hold the Ctrl-C, and the launch kills ranks that
    would die of its stop signal at once. 15 s: far below the 60 s that waiting for them takes."""
    terminal = in_terminal(how, body=IMPORTING)
    for _ in range(2):
        terminal.expect_exact("importing")
    sent = time.monotonic()
    terminal.sendintr()
    terminal.expect_exact("INTERRUPTED")
    took, echoed = time.monotonic() - sent, terminal.before
    finish(terminal)
    assert echoed.replace("^C", "").strip() == "", echoed
    assert took < 15, f"the call ended {took:.1f} s after Ctrl-C"
