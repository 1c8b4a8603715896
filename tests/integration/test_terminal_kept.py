"""The caller's terminal after a launch that stopped its ranks, in a real pseudo-terminal (pexpect). The
script prints the terminal's local modes before and after the call: a call that ends with an error gives the
user's terminal back as it found it (echo, canonical input, signals)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pexpect  # type: ignore[import-untyped]
import psutil
import pytest

from tests.helpers import REPO

SCRIPT = """
    import sys, termios, time, tty
    from mplaunch import parallel, worker_info

    def modes() -> str:
        lflag = termios.tcgetattr(0)[3]
        return " ".join(f"{name}={int(bool(lflag & getattr(termios, name)))}" for name in ("ECHO", "ICANON", "ISIG"))

    def both_stop() -> int:
        breakpoint()
        return worker_info().rank

    def raw_then_hang() -> None:
        if worker_info().rank == 0:
            tty.setraw(0)
        print("raw", worker_info().rank, flush=True)
        time.sleep(100)

    if __name__ == "__main__":
        mode, start_method = sys.argv[1], sys.argv[2]
        print("BEFORE", modes(), flush=True)
        try:
            launch = parallel(nprocs=2, start_method=start_method, timeout=float(sys.argv[3]))(globals()[mode])
            print("RESULT", launch())
        except BaseException as error:
            print("RAISED", type(error).__name__, flush=True)
        print("AFTER", modes(), flush=True)
"""


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[list[pexpect.spawn]]:
    started: list[pexpect.spawn] = []
    yield started
    for child in started:
        if child.isalive():
            for process in psutil.Process(child.pid).children(recursive=True):
                process.kill()
            child.close(force=True)


def _start(started: list[pexpect.spawn], tmp_path: Path, *args: str) -> pexpect.spawn:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONBREAKPOINT", None)
    child = pexpect.spawn(
        sys.executable, [str(script), *args], env=env, cwd=str(tmp_path), timeout=60, encoding="utf-8"
    )
    started.append(child)
    return child


def _modes(child: pexpect.spawn, tag: str) -> str:
    child.expect(tag + r" (ECHO=\d ICANON=\d ISIG=\d)\r?\n")
    return str(child.match.group(1))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ctrl_c_at_a_ranks_pdb_prompt_gives_the_terminal_back_with_echo(
    terminal: list[pexpect.spawn], tmp_path: Path, start_method: str
) -> None:
    """Both ranks call breakpoint(); Ctrl-C at the first ``(Pdb rank N)`` prompt. The call ends
    (KeyboardInterrupt); the terminal was left as pdb's readline set it while prompting: no echo, no
    canonical input (``-echo -icanon`` after the program; a shell keeps it so)."""
    child = _start(terminal, tmp_path, "both_stop", start_method, "60")
    before = _modes(child, "BEFORE")
    child.expect(r"\(Pdb rank \d\) ")
    child.sendintr()
    child.expect_exact("RAISED KeyboardInterrupt")
    assert _modes(child, "AFTER") == before  # it was ECHO=0 ICANON=0 ISIG=1
    child.expect(pexpect.EOF)


def test_a_rank_stopped_after_it_set_raw_mode_leaves_the_terminal_as_found(
    terminal: list[pexpect.spawn], tmp_path: Path
) -> None:
    """Rank 0 calls ``tty.setraw(0)`` and the launch times out; mplaunch stops it (SIGTERM, then SIGKILL). The
    terminal stayed raw after the call: no echo, and Ctrl-C no longer interrupted. A shell restores the modes
    of a job that a signal killed, not of one that exits normally, as the launching program does here."""
    child = _start(terminal, tmp_path, "raw_then_hang", "fork", "5")
    before = _modes(child, "BEFORE")
    child.expect_exact("RAISED LaunchTimeoutError", timeout=60)
    assert _modes(child, "AFTER") == before  # it was ECHO=0 ICANON=0 ISIG=0
    child.expect(pexpect.EOF)
