"""The one timing helper, the parent's peak memory and the one in-process copy baseline (standard library only
at import, so the import-time probe can use :func:`timed` before importing torch)."""

from __future__ import annotations

import signal
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any


def timed(call: Callable[[], Any], repeats: int = 1, timeout: float = 120.0) -> tuple[list[float], Any]:
    """Wall seconds of ``repeats`` calls of ``call``, each stopped by SIGALRM (``TimeoutError``) after
    ``timeout`` seconds (forked children do not inherit the timer), and the last call's value."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"a timed call did not finish within {timeout:g} s")

    samples, value = [], None
    previous = signal.signal(signal.SIGALRM, expire)
    try:
        for _ in range(repeats):
            signal.setitimer(signal.ITIMER_REAL, timeout)
            start = time.perf_counter()
            value = call()
            samples.append(time.perf_counter() - start)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return samples, value


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class PeakRss:
    """This process's peak resident set size since :meth:`reset`, in bytes, from the kernel: ``reset`` writes
    5 to ``/proc/self/clear_refs`` (sets ``VmHWM`` to the current RSS, Linux >= 4.0), so the peak is exact
    however briefly it lasted. Shared-memory pages count once touched, so touch results before reading it."""

    @staticmethod
    def _field(name: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(name + ":"))

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        self.base = self._field("VmRSS")

    def increase(self) -> int:
        return self._field("VmHWM") - self.base


def one_copy_seconds(source: Any, repeats: int) -> list[float]:
    """Seconds of one copy of ``source`` (a tensor or NumPy array) into a new shared-memory file, allocation
    and page faults included: the least any process-to-process transfer of a ready buffer can cost."""
    import tempfile

    import torch

    flat = torch.as_tensor(source).reshape(-1).view(torch.uint8)

    def copy() -> None:
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as file:
            torch.from_file(file.name, shared=True, size=flat.numel(), dtype=torch.uint8).copy_(flat)

    return timed(copy, repeats)[0]
