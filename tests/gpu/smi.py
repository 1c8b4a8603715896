"""GPU memory read with ``nvidia-smi``: the checking process never initialises CUDA to read it."""

from __future__ import annotations

import subprocess
import time


def used_mib() -> int:
    """MiB in use on all GPUs, as ``nvidia-smi`` reads it."""
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return sum(int(line) for line in done.stdout.split())


def total_mib() -> int:
    """MiB of the first GPU, as ``nvidia-smi`` reads it."""
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(done.stdout.split()[0])


def seconds_until_freed(baseline: int, within: float = 10.0, slack: int = 512) -> float:
    """Return the seconds until the GPUs' memory in use is back to ``baseline`` MiB (plus ``slack``); fail
    after ``within`` seconds."""
    start = time.monotonic()
    while (used := used_mib()) > baseline + slack:
        waited = time.monotonic() - start
        assert waited < within, f"{used - baseline} MiB still in use {waited:.1f} s after the rank ended"
        time.sleep(0.2)
    return time.monotonic() - start
