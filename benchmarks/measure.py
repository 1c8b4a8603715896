"""Measuring helpers used inside one benchmark process: a launch deadline, the parent's peak RSS, page
touching, and the in-process baselines (one copy into shared memory, a pickle round trip, state restore)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


class DeadlineExceeded(Exception):
    """A launch ran past its deadline."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` in the main thread after ``seconds`` (SIGALRM), whatever the launcher
    is doing; forked children do not inherit the timer."""

    def expire(signum: int, frame: object) -> None:
        raise DeadlineExceeded(f"the launch did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class PeakRss:
    """This process's resident set size and its peak since :meth:`reset`, in bytes, read from the kernel.

    ``reset`` writes 5 to ``/proc/self/clear_refs``, which sets the kernel's high-water mark (``VmHWM``) to
    the current RSS (Linux >= 4.0). The peak is then exact, however briefly it lasted: no sampling thread
    that could miss it and no fresh process per measurement. Pages of a shared-memory mapping count once
    touched (``RssShmem``), which is why results are touched before the peak is read.
    """

    @staticmethod
    def supported() -> bool:
        return os.access("/proc/self/clear_refs", os.W_OK)

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    def reset(self) -> int:
        """Set the peak to the current RSS and return it."""
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")


def touch(value: Any) -> None:
    """Read one byte of every page of every tensor in ``value`` (a tensor or a tuple/list/dict of them), so
    memory that is mapped but not yet read is faulted in, as the first real use of the result would.

    NumPy does the reading, single-threaded: a torch reduction this large would start this process's OpenMP
    thread pool, and GNU OpenMP hangs in a forked child that then runs a parallel torch operation (launchers
    that fork without limiting threads, like ``elastic_launch``, would then hang building the next payload).
    """
    import numpy

    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1).view(torch.uint8)
        int(numpy.add.reduce(flat[::PAGE].numpy(), dtype=numpy.int64))
    elif isinstance(value, dict):
        for item in value.values():
            touch(item)
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        for item in value:
            touch(item)


def payload_size_ok(value: Any, nbytes: int | None, kind: str) -> bool:
    """Whether the returned ``value`` is the payload ``kind`` that was sent."""
    if nbytes is not None:
        return isinstance(value, torch.Tensor) and value.nbytes == nbytes
    if kind == "int":
        return bool(value == 42)
    return isinstance(value, list) and len(value) == 10**6 and value[-1] == 10**6 - 1


def shm_copy_seconds(source: torch.Tensor) -> float:
    """Time of one copy of ``source`` into a new shared-memory storage (allocation and page faults
    included): the least any process-to-process transfer of a ready tensor can cost."""
    start = time.perf_counter()
    storage = torch.UntypedStorage._new_shared(source.nbytes)
    target = torch.empty(0, dtype=source.dtype).set_(storage, 0, source.shape, source.stride())
    target.copy_(source)
    elapsed = time.perf_counter() - start
    del target, storage
    return elapsed


def pickle_round_trip_seconds(value: Any) -> float:
    """Time of ``pickle.loads(pickle.dumps(value))`` at the highest protocol."""
    start = time.perf_counter()
    pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return time.perf_counter() - start


def median_call_seconds(function: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``function()`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
