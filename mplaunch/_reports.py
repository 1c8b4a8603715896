"""What a launch's ranks cost and how they ended: :class:`RunReport`, one :class:`RankReport` per rank."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankReport:
    """How one rank's worker ended and what it used, as the kernel counted it.

    Attributes:
        rank: the global rank.
        pid: its worker's process id.
        exitcode: its exit code as ``multiprocessing`` gives it (negative ``-N``: killed by signal ``N``),
            or ``None`` if it was never seen to end.
        signal_name: the signal that killed it (e.g. ``"SIGKILL"``), else ``None``.
        max_rss: its peak resident memory, in bytes, or ``None`` when unknown (a worker killed by a signal
            that was not the parent's to reap: a fork server's, or one the caller's code reaped).
        user_time: CPU seconds it spent in user mode, or ``None`` when unknown.
        system_time: CPU seconds it spent in the kernel, or ``None`` when unknown.
        wall_time: seconds from its start to its end, as the parent saw them.
        oom: whether the out-of-memory killer ended it: as ``mplaunch.WorkerExitedError.oom``.
        stopped: whether its exit is the launch's stop (SIGTERM, then SIGKILL after ``grace_period``):
            it still ran when another rank failed, or a timeout, a stall, a cancel or a signal to the parent
            ended the launch. Its exit code is then the stop's (``143``: 128 + SIGTERM, as a shell shows
            it; ``-9``: killed after the grace period), not one it chose.
    """

    rank: int
    pid: int | None
    exitcode: int | None
    signal_name: str | None
    max_rss: int | None
    user_time: float | None
    system_time: float | None
    wall_time: float | None
    oom: bool | None
    stopped: bool = False


@dataclasses.dataclass(frozen=True)
class RunReport:
    """A launch's account, per rank: reachable as ``fn.last_report`` after a call, ``future.report`` from a
    submitted launch, and ``error.report`` on every error a launch raises.

    Attributes:
        ranks: one [`RankReport`][mplaunch.RankReport] per rank of this node, of the launch's last attempt, in rank
            order; empty when no worker was started, or for a multi-node launch (torch elastic runs its workers).
        wall_time: seconds the whole launch took, restarts included.
        restarts: how many times the workers were restarted (``max_restarts``).
    """

    ranks: tuple[RankReport, ...]
    wall_time: float
    restarts: int = 0

    def __str__(self) -> str:
        lines = [f"launch: {self.wall_time:.2f} s, {self.restarts} restart(s)"]
        for r in self.ranks:
            memory = "?" if r.max_rss is None else f"{r.max_rss / 2**20:.0f} MiB"
            cpu = "?" if r.user_time is None or r.system_time is None else f"{r.user_time + r.system_time:.2f} s"
            end = "running" if r.exitcode is None and r.signal_name is None else r.signal_name or f"exit {r.exitcode}"
            end += " (stopped by the launch)" if r.stopped else ""
            wall = "?" if r.wall_time is None else f"{r.wall_time:.2f} s"
            lines.append(f"rank {r.rank} (pid {r.pid}): {end}, peak RSS {memory}, CPU {cpu}, wall {wall}")
        return "\n".join(lines)
