"""The stacks signal and files, and the board: an ``mmap``ed file of per-rank slots. A heartbeat is one store of
``time.monotonic()`` (one clock for every process of a machine); peak RSS and CPU times are written at exit."""

from __future__ import annotations

import mmap
import os
import signal

# Real-time: SIGUSR1/2 belong to the user, glibc reserves the first real-time signals; None on macOS (no stacks).
STACKS_SIGNAL: int | None = signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else None
BOARD = "board"
FIELDS = 4  # doubles per rank: last beat, peak RSS (bytes), user CPU (s), system CPU (s)
BEAT, MAX_RSS, USER_TIME, SYSTEM_TIME = range(FIELDS)


def stacks_name(rank: int) -> str:
    """Name the file ``rank`` writes its stacks to (it exists once the rank can dump)."""
    return f"rank{rank}.stacks"


def stacks_pending_name(rank: int) -> str:
    """Name the stacks file while the rank sets up its dump (renamed to :func:`stacks_name` once it can)."""
    return f"rank{rank}.stacks-setup"


class Board:
    """Map the per-rank slots of ``directory/board``; the parent creates it (zeroed) once per attempt."""

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
        """Read field ``field`` of ``rank`` (``0.0``: never written)."""
        return float(self.slots[rank * FIELDS + field])

    def set(self, rank: int, field: int, value: float) -> None:
        """Write field ``field`` of ``rank``."""
        self.slots[rank * FIELDS + field] = value

    def clear(self) -> None:
        """Zero every slot (a new attempt)."""
        self._map[:] = bytes(len(self._map))

    def close(self) -> None:
        """Unmap; the slots must not be used after."""
        self.slots.release()
        self._map.close()
