"""Waiting for descriptors to become readable: a pidfd (its process ended), a pipe (written, or closed), a
listening socket (a connection came)."""

from __future__ import annotations

import math
import select
from collections.abc import Sequence


def readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """The descriptors of ``fds`` that are readable, hung up or in error, waiting up to ``timeout`` seconds
    for one (``None``: without limit; ``0``: not at all): what ``multiprocessing.connection.wait`` answers
    for descriptors, with one ``poll`` object and no selector per call (a launch waits a few times, and
    each wait's objects are memory its parent writes while its workers share its pages).

    Args:
        fds: open file descriptors.
        timeout: seconds; rounded up to the millisecond, at most ``poll``'s 24.8 days (the caller looks again
            then: a launch's loop computes what is left of its own timeout).

    Raises:
        OSError: ``poll`` failed (not for an interrupted wait: Python retries it, with what is left of
            ``timeout``).
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    milliseconds = None if timeout is None else min(math.ceil(max(0.0, timeout) * 1000), _LONGEST)
    return [fd for fd, _ in poller.poll(milliseconds)]


_LONGEST = 2**31 - 1  # poll's limit, in milliseconds (24.8 days): a longer timeout waits this long, then looks again
#: The longest one ``poll`` waits, in seconds: a caller with a longer timeout waits this long, then again.
LONGEST_WAIT = _LONGEST / 1000
