"""Waiting for descriptors to become readable: a pidfd (its process ended), a pipe, a listening socket."""

from __future__ import annotations

import math
import select
from collections.abc import Sequence


def readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """Return the ``fds`` readable (or hung up) within ``timeout`` seconds, at most :data:`LONGEST_WAIT` (one poll)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    milliseconds = None if timeout is None else min(math.ceil(max(0.0, timeout) * 1000), _LONGEST)
    return [fd for fd, _ in poller.poll(milliseconds)]


_LONGEST = 2**31 - 1  # poll's limit, in milliseconds (24.8 days): a caller with a longer timeout waits again
LONGEST_WAIT = _LONGEST / 1000
