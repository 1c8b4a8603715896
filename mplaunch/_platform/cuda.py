"""The CUDA driver, asked without initialising it here: after ``cuInit`` (``torch.cuda.is_available()`` runs it)
a forked child cannot use CUDA, even when no context was made (PyTorch's "poison fork" note)."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

_COUNT = (  # run in a throwaway interpreter
    "import ctypes as c\ntry: d, n = c.CDLL('libcuda.so.1'), c.c_int(0)\nexcept OSError: print(0)\n"
    "else: print(n.value if d.cuInit(0) == 0 == d.cuDeviceGetCount(c.byref(n)) else 0)"
)


def driver_initialised() -> bool:
    """Tell whether ``cuInit`` succeeded here (``cuDeviceGetCount`` fails before it), without loading the driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return int(driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int(0)))) == 0


@functools.lru_cache(maxsize=8)
def driver_device_count(visible: str | None) -> int:
    """Count the devices under ``CUDA_VISIBLE_DEVICES=visible`` in a throwaway interpreter (``cuInit`` runs there)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _COUNT], capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0
