"""What a worker knows of itself apart from its spec: read by its signal handler, its run and its exit."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class WorkerState:
    """This worker's own state (one per process: :data:`state`)."""

    pid: int = -1  # set at start (a process the function forks is not the worker); -1: no worker
    signal_received: int | None = None  # the first stop signal
    signal_at: float = 0.0  # when it came (time.monotonic())
    raised: tuple[BaseException, float] | None = None  # the function's error and when: its outcome
    outcome_decided: bool = False  # from then on, signals are noted and ignored
    children_stopped: bool = False  # the last exit handler stopped what the rank started
    parents_exits_kept: bool = False  # the parent's atexit handlers stay registered, below the rank's
    leaving: int | None = None  # the exit code the rank's last atexit handler ends it with
    environ_made: bool = False  # the rank installed the environment its parent made for it


state = WorkerState()
