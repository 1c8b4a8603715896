"""What a worker process knows of itself while it runs, apart from its spec: one object, read by its signal
handler, its function's run and its exit handlers."""

from __future__ import annotations


class WorkerState:
    """This worker's own state (one per process: :data:`state`).

    Attributes:
        pid: this worker's pid, set at start (a process the function forks is not the worker); ``-1`` in a
            process that is no worker.
        signal_received: the first stop signal this worker got, or ``None``.
        signal_at: when (``time.monotonic()``) it came.
        raised: what the function raised, and when: its outcome, whatever follows.
        outcome_decided: from then on, signals are noted and ignored.
        children_stopped: the last exit handler stopped what the rank started.
        parents_exits_kept: the parent's ``atexit`` handlers stay registered, below the rank's own.
        leaving: the exit code with which the rank's last ``atexit`` handler ends it, or ``None``.
        environ_made: the rank installed the environment its parent made for it (``fork_environs``).
    """

    __slots__ = (
        "children_stopped",
        "environ_made",
        "leaving",
        "outcome_decided",
        "parents_exits_kept",
        "pid",
        "raised",
        "signal_at",
        "signal_received",
    )

    def __init__(self) -> None:
        self.pid = -1
        self.signal_received: int | None = None
        self.signal_at = 0.0
        self.raised: tuple[BaseException, float] | None = None
        self.outcome_decided = False
        self.children_stopped = False
        self.parents_exits_kept = False
        self.leaving: int | None = None
        self.environ_made = False


#: This process's.
state = WorkerState()
