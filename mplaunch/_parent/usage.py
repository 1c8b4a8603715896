"""What each rank of a launch cost and how it ended, from the kernel (the records of :mod:`mplaunch._reports`).
A child worker is reaped with ``wait4`` (peak memory, CPU time, even after a SIGKILL) and multiprocessing told
its exit code; a fork server's workers leave their own account on the board. Each worker's cgroup OOM-kill
count is read before it starts and, only after a SIGKILL (the killer's signal), before it is reaped."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from multiprocessing.process import BaseProcess

from mplaunch._errors import signal_name
from mplaunch._platform.oom import oom_counters, oom_kills
from mplaunch._platform.pidfd import reaped_status
from mplaunch._reports import RankReport
from mplaunch._wire.board import MAX_RSS, SYSTEM_TIME, USER_TIME, Board


class RankRecords:
    """The parent's notes on each worker of one attempt: start, cgroup counts, end, usage."""

    def __init__(self, board: Board | None, start_method: str) -> None:
        self.board = board
        self.children = start_method != "forkserver"
        self._started: dict[int, float] = {}
        self._ended: dict[int, float] = {}
        self._counters: dict[int, tuple[tuple[str, ...], int | None]] = {}
        self._usage: dict[int, tuple[int, float, float]] = {}
        self._oom_kills: dict[int, int | None] = {}
        # children start in this process's cgroup: its count, read once, before any of them starts
        self._own: tuple[tuple[str, ...], int | None] | None = None
        if self.children:
            counters = oom_counters(os.getpid())
            self._own = (counters, oom_kills(counters))

    def started(self, rank: int, pid: int | None, at: float | None = None) -> None:
        """Note that ``rank`` started as ``pid`` at ``at`` (default now), with its cgroup's OOM-kill count."""
        self._started[rank] = time.monotonic() if at is None else at
        if self._own is not None:
            self._counters[rank] = self._own
        else:
            counters = oom_counters(pid) if pid is not None else ()
            self._counters[rank] = (counters, oom_kills(counters))

    def reap(self, rank: int, process: BaseProcess, pidfd: int | None = None) -> None:
        """Reap ``rank``'s worker once, keeping the kernel's account; ``pidfd``: its status if a SIGCHLD handler did."""
        if rank in self._ended:
            process.join()
            return
        popen, pid = getattr(process, "_popen", None), process.pid
        if not self.children or popen is None or popen.returncode is not None or pid is None:
            self._count_oom_kills(rank)  # not this process's to reap, or reaped already
        else:
            if _killed(pid):  # only a SIGKILL can be the killer's
                self._count_oom_kills(rank)
            try:
                found, status, usage = os.wait4(pid, 0)
            except ChildProcessError:  # reaped by someone else: the kernel may still tell the exit status
                reaped = None if pidfd is None else reaped_status(pidfd)
                if reaped is not None and popen.returncode is None:
                    popen.returncode = os.waitstatus_to_exitcode(reaped)
                    if popen.returncode == -signal.SIGKILL and rank not in self._oom_kills:
                        self._count_oom_kills(rank)  # its cgroup's count, read after the fact
            else:
                if found == pid:
                    popen.returncode = os.waitstatus_to_exitcode(status)
                    self._usage[rank] = (usage.ru_maxrss * 1024, usage.ru_utime, usage.ru_stime)
        process.join()
        self._ended[rank] = time.monotonic()

    def _count_oom_kills(self, rank: int) -> None:
        """Note the kills ``rank``'s cgroup counted since it started (read before it is reaped)."""
        counters, before = self._counters.get(rank, ((), None))
        after = oom_kills(counters)
        self._oom_kills[rank] = None if before is None or after is None else after - before

    def oom_kills(self, rank: int) -> int | None:
        """Return how many processes the OOM killer ended in ``rank``'s cgroup while it ran, or ``None``."""
        return self._oom_kills.get(rank)

    def report(
        self, processes: list[BaseProcess], states: Mapping[int, object], stopped: set[int]
    ) -> tuple[RankReport, ...]:
        """Return one :class:`RankReport` per rank (a rank the launch ``stopped`` was not the OOM killer's)."""
        found = []
        for rank, process in enumerate(processes):
            usage = self._usage.get(rank) or self._board_usage(rank)
            exitcode = process.exitcode if rank in self._ended else None
            started, ended = self._started.get(rank), self._ended.get(rank)
            oom = getattr(states.get(rank), "oom", None)
            if oom is None and (rank in stopped or (exitcode is not None and exitcode != -9)):
                oom = False
            elif oom is None and (kills := self._oom_kills.get(rank)) is not None:
                oom = kills > 0
            found.append(
                RankReport(
                    rank=rank,
                    pid=process.pid,
                    exitcode=exitcode,
                    signal_name=signal_name(exitcode),
                    max_rss=None if usage is None else usage[0],
                    user_time=None if usage is None else usage[1],
                    system_time=None if usage is None else usage[2],
                    wall_time=None if started is None or ended is None else ended - started,
                    oom=oom,
                    stopped=rank in stopped and exitcode is not None and (exitcode < 0 or exitcode >= 128),
                )
            )
        return tuple(found)

    def _board_usage(self, rank: int) -> tuple[int, float, float] | None:
        if self.board is None:
            return None
        try:
            rss = self.board.get(rank, MAX_RSS)
            return (int(rss), self.board.get(rank, USER_TIME), self.board.get(rank, SYSTEM_TIME)) if rss else None
        except (ValueError, IndexError):  # the board is closed
            return None


def live_usage(pid: int | None) -> tuple[int, float, float] | None:
    """Return a running process's peak RSS (bytes) and user and system CPU seconds from ``/proc``, or ``None``."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as status:
            peak = next(line for line in status if line.startswith(b"VmHWM:"))
    except (OSError, IndexError, StopIteration):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return int(peak.split()[1]) * 1024, int(fields[11]) / ticks, int(fields[12]) / ticks


def _killed(pid: int) -> bool:
    """Tell, without reaping, whether child ``pid`` may have ended by SIGKILL (also: not ended yet, unknown)."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return True
    return found is None or (found.si_code == os.CLD_KILLED and found.si_status == signal.SIGKILL)
