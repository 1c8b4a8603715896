"""The parent's pump and the prefixing, in one process: the test writes to the pipes a worker would get."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mplaunch._errors import LaunchRefusedError
from mplaunch._output.lines import prefixed
from mplaunch._output.pump import DRAIN, HOLD, Pump, should_route
from mplaunch._output.rank_streams import RANK_MARK


def _consoles(monkeypatch: pytest.MonkeyPatch) -> tuple[io.StringIO, io.StringIO]:
    """Replace the console streams (in the test itself: pytest sets its own at the start of the call)."""
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    return out, err


def _write(pump: Pump, rank: int, text: str, err: bool = False) -> None:
    os.write(pump.writers[2 * rank + err], text.encode())


def _wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"the pump did not get there within {timeout} s"
        time.sleep(0.005)


def _unread(fd: int) -> int:
    """Bytes in the pipe of ``fd`` (either end) that the pump has not read yet."""
    count: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    return count


def test_prefix_at_each_line_start_and_after_carriage_returns() -> None:
    assert prefixed("a\n\nb", "[r] ", True) == ("[r] a\n[r] \n[r] b", False)
    assert prefixed("c\n", "[r] ", False) == ("c\n", True)
    assert prefixed("\r 10%\r 20%", "[r] ", True) == ("\r[r]  10%\r[r]  20%", False)
    assert prefixed("x\r\ny", "", True) == ("x\r\ny", True)


def test_lines_are_whole_filtered_and_logged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([0, 1], prefix=True, console_ranks=frozenset({0}), log_dir=str(tmp_path))
    pump.start(keep_writers=True)
    _write(pump, 0, "a")
    _write(pump, 1, "hidden\n")
    _write(pump, 0, "b\n")
    # stdout and stderr are two pipes: no order between them but the order of reading
    _wait_until(lambda: consoles[0].getvalue() == "[rank 0] ab\n")
    _write(pump, 0, "oops\n", err=True)
    _write(pump, 0, "no newline")
    pump.close()
    assert consoles[0].getvalue() == "[rank 0] ab\n[rank 0] no newline\n"
    assert consoles[1].getvalue() == "[rank 0] oops\n"
    assert (tmp_path / "rank1.log").read_text() == "[rank 1] hidden\n"
    assert (tmp_path / "rank0.log").read_text() == "[rank 0] ab\n[rank 0] oops\n[rank 0] no newline\n"


def test_partial_line_is_live_and_never_split_by_another_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([0, 1], prefix=True, console_ranks=None, log_dir=None)
    pump.start(keep_writers=True)
    _write(pump, 0, "\r 10%")
    _wait_until(lambda: "10%" in consoles[0].getvalue())
    assert consoles[0].getvalue() == "\r[rank 0]  10%"  # forwarded before its line ends
    _write(pump, 1, "other\n")
    held = time.monotonic()
    _wait_until(lambda: "other" in consoles[0].getvalue())  # the open line is cut after HOLD seconds
    assert time.monotonic() - held >= HOLD
    _write(pump, 0, "\r 20%\n")
    pump.close()
    assert consoles[0].getvalue() == "\r[rank 0]  10%\n[rank 1] other\n\r[rank 0]  20%\n"


def test_another_ranks_line_waits_for_an_open_line_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([0, 1], prefix=True, console_ranks=None, log_dir=None)
    pump.start(keep_writers=True)
    _write(pump, 0, "start ")
    _wait_until(lambda: consoles[0].getvalue() == "[rank 0] start ")  # the open line
    _write(pump, 1, "other\n")
    _write(pump, 0, "end\n")
    pump.close()
    assert consoles[0].getvalue() == "[rank 0] start end\n[rank 1] other\n"


def test_rank_mark_names_the_rank_of_what_follows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([None], prefix=True, console_ranks=None, log_dir=str(tmp_path))
    pump.start(keep_writers=True)
    mark = RANK_MARK + b"5\x00"
    os.write(pump.writers[0], mark[:4])
    _wait_until(lambda: _unread(pump.writers[0]) == 0)  # the rest comes in a later read
    os.write(pump.writers[0], mark[4:] + "hé\n".encode())
    pump.close()
    assert consoles[0].getvalue() == "[rank 5] hé\n"
    assert (tmp_path / "rank5.log").read_text() == "[rank 5] hé\n"


def test_close_does_not_wait_for_a_writer_left_open(monkeypatch: pytest.MonkeyPatch) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([0], prefix=False, console_ranks=None, log_dir=None)
    leftover = os.dup(pump.writers[0])  # like a grandchild that inherited the pipe and lives on
    try:
        pump.start()
        os.write(leftover, b"from a leftover\n")
        started = time.monotonic()
        pump.close()
        assert time.monotonic() - started < DRAIN + 2
    finally:
        os.close(leftover)
    assert consoles[0].getvalue() == "from a leftover\n"


def test_routes_when_an_option_is_set_or_the_console_is_not_fd_1(monkeypatch: pytest.MonkeyPatch) -> None:
    assert should_route(True, None, None)
    assert should_route(False, frozenset({0}), None)
    monkeypatch.setattr("sys.stdout", io.StringIO())  # e.g. a Jupyter kernel's stream, redirect_stdout
    assert should_route(False, None, None)


def test_an_unwritable_log_dir_is_refused_before_any_pipe_is_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    open_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LaunchRefusedError, match="log_dir=.*file/logs"):
        Pump([0], prefix=False, console_ranks=None, log_dir=str(blocker / "logs"))
    assert len(os.listdir("/proc/self/fd")) == open_fds


def test_a_template_takes_the_announced_pid_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    consoles = _consoles(monkeypatch)
    pump = Pump([None], prefix="{rank}|{pid}|{node_rank}|{local_rank} ", console_ranks=None, log_dir=None)
    pump.start(keep_writers=True)
    os.write(pump.writers[0], RANK_MARK + b"5,4321,1\x00" + "hé\n".encode())
    pump.close()
    assert consoles[0].getvalue() == "5|4321|1|0 hé\n"
