"""The worker's side of watching a launch: stacks on request, the heartbeat, usage at exit, NCCL's flight recorder.

:mod:`faulthandler` writes ``rank{N}.stacks`` from the signal handler, without the GIL, so a rank blocked in C
dumps too. The file gets its final name once the handler is in place: before, the signal would kill the rank."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import resource
import time
from typing import Any

from mplaunch._wire.board import (
    BEAT,
    FIELDS,
    MAX_RSS,
    STACKS_SIGNAL,
    SYSTEM_TIME,
    USER_TIME,
    Board,
    stacks_name,
    stacks_pending_name,
)
from mplaunch._wire.spec import WorkerSpec

_board: Board | None = None
_rank = 0
_slots: Any = None  # the board's slots (a memoryview of doubles) while this process is a watched worker
_index = 0  # this rank's beat slot
_monotonic = time.monotonic

#: NCCL's flight recorder (torch.distributed): what it keeps, and a dump when a collective times out.
_NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def heartbeat() -> None:
    """Tell the launch that this rank is making progress; call it e.g. once per training step.

    With the ``stall_timeout`` option, a rank that has called ``heartbeat()`` once and then not again for
    ``stall_timeout`` seconds is stalled: the launch collects every rank's stacks, stops the workers and
    raises [`StallError`][mplaunch.StallError] (or restarts, with ``max_restarts``). A rank that never calls it is
    not watched. One store into memory shared with the parent, no system call: about 0.1 µs. Outside a
    launch (in the parent, in ``fn.debug()``, under another launcher, in a process a rank forked) it does
    nothing.

    Example:
        ```python title="Fragment: the loop of a function decorated with stall_timeout"
        for batch in loader:
            train_step(batch)
            mplaunch.heartbeat()
        ```
    """
    slots = _slots
    if slots is not None:
        slots[_index] = _monotonic()


def watch(spec: WorkerSpec, rank: int) -> None:
    """Set up stacks on request, the heartbeat's board and NCCL's flight recorder, as ``spec`` asks."""
    global _board, _rank, _slots, _index
    _flight_recorder(spec)
    if spec.launch.stacks and STACKS_SIGNAL is not None:  # (None: no real-time signals here)
        pending = os.path.join(spec.launch.directory, stacks_pending_name(rank))
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
            # the parent may signal from now on
            os.rename(pending, os.path.join(spec.launch.directory, stacks_name(rank)))
    if spec.launch.stacks or spec.launch.board:
        os.register_at_fork(after_in_child=_forget)
    if not spec.launch.board:
        return
    try:
        _board = Board(spec.launch.directory, spec.launch.nprocs, create=False)
    except (OSError, ValueError):
        return  # a multi-node launch (elastic's agent watches those workers), or the launch is ending
    _rank, _index, _slots = rank, rank * FIELDS + BEAT, _board.slots


def record_usage() -> None:
    """Write peak memory and CPU time to the board: a fork server's worker is not the parent's child."""
    if _board is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with contextlib.suppress(ValueError):
        _board.set(_rank, MAX_RSS, float(usage.ru_maxrss * 1024))  # KiB on Linux
        _board.set(_rank, USER_TIME, usage.ru_utime)
        _board.set(_rank, SYSTEM_TIME, usage.ru_stime)


def _forget() -> None:
    """Stop beating and dumping in a process the worker forks: it is not the rank."""
    global _board, _slots
    _board = _slots = None
    if STACKS_SIGNAL is not None:
        with contextlib.suppress(RuntimeError, ValueError):
            faulthandler.unregister(STACKS_SIGNAL)


def _flight_recorder(spec: WorkerSpec) -> None:
    """With nccl and ``log_dir``, dump NCCL's flight recorder to ``log_dir`` on a timeout, unless the user chose."""
    if spec.launch.backend != "nccl" or spec.launch.log_dir is None:
        return
    for name, value in _NCCL_FLIGHT_RECORDER.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(spec.launch.log_dir, "nccl_trace_rank_"))
