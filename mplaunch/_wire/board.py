"""What the parent and its workers share to watch a running launch: the signal that makes a rank dump its
stacks, the per-rank files those dumps go to, and the board of per-rank slots (heartbeats, usage).

The board is a small file in the launch directory that both sides map (``mmap``): per rank, four doubles:
the ``time.monotonic()`` of its last :func:`mplaunch.heartbeat` (``0.0``: never), and the worker's own peak
resident memory (bytes), user and system CPU time (seconds), written once when it exits (``0.0``: not
written). ``CLOCK_MONOTONIC`` is one clock for every process of a machine, so the parent compares a beat
with its own clock. A beat is one store into shared memory: no system call.
"""

from __future__ import annotations

import mmap
import os
import signal

#: The signal that makes a worker write its stacks (``faulthandler.register``). A real-time signal: SIGUSR1
#: and SIGUSR2 belong to the user (forwarded to ranks), and glibc reserves the first real-time signals.
#: ``None`` where there are no real-time signals (macOS): no stacks are collected there.
STACKS_SIGNAL: int | None = signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else None
#: The board's name in the launch directory.
BOARD = "board"
#: Doubles per rank on the board: last beat, peak RSS (bytes), user CPU (s), system CPU (s).
FIELDS = 4
BEAT, MAX_RSS, USER_TIME, SYSTEM_TIME = range(FIELDS)


def stacks_name(rank: int) -> str:
    """The file in the launch directory where ``rank`` writes its stacks (it exists once the rank can dump)."""
    return f"rank{rank}.stacks"


def stacks_pending_name(rank: int) -> str:
    """The same file while the rank sets up its dump (renamed to :func:`stacks_name` when it can dump)."""
    return f"rank{rank}.stacks-setup"


class Board:
    """The per-rank slots of one launch, mapped from ``directory/board``.

    Args:
        directory: the launch directory.
        nprocs: the ranks on this node.
        create: make the file (zeroed: nobody has beaten yet); the parent does, once per attempt.

    Attributes:
        slots: ``nprocs * FIELDS`` doubles; rank ``r``'s field ``f`` is ``slots[r * FIELDS + f]``.
    """

    def __init__(self, directory: str, nprocs: int, *, create: bool) -> None:
        path = os.path.join(directory, BOARD)
        size = 8 * FIELDS * max(1, nprocs)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if create else os.O_RDWR
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slots = memoryview(self._map).cast("d")

    def get(self, rank: int, field: int) -> float:
        """Field ``field`` of ``rank`` (``0.0``: never written)."""
        return float(self.slots[rank * FIELDS + field])

    def set(self, rank: int, field: int, value: float) -> None:
        """Write field ``field`` of ``rank``."""
        self.slots[rank * FIELDS + field] = value

    def clear(self) -> None:
        """Zero every slot (a new attempt: nobody has beaten yet)."""
        self._map[:] = bytes(len(self._map))

    def close(self) -> None:
        """Unmap; the slots must not be used after."""
        self.slots.release()
        self._map.close()
