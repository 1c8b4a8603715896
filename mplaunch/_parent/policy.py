"""How many intra-op threads each worker uses, and keeping forked workers clear of OpenMP's thread pool.

GNU OpenMP (libgomp, which PyTorch's Linux wheels ship) keeps a pool of threads after the first parallel
region. ``fork`` copies only the calling thread, so a forked child that enters a parallel region waits
forever for pool threads that do not exist in it. OpenMP 5.0's ``omp_pause_resource_all(omp_pause_hard)``
(OpenMP API 5.0, section 3.2.43) frees the pool; libgomp, LLVM's libomp and Intel's libiomp implement it.
Calling it in the parent just before forking gives every forked worker a clean runtime that starts its own
pool, so workers keep ``cores // nprocs`` threads; the parent's pool is rebuilt on its next parallel region
(a few threads created, microseconds). Only where no runtime can be paused (another thread of the parent is
inside a parallel region, or an OpenMP without the call) do forked workers fall back to one thread, as
PyTorch's own DataLoader workers always do.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from mplaunch._config import usable_cpu_count
from mplaunch._frames import warn_at_user

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_RUNTIME_PATH = re.compile(r"(/[^ \n]*/lib(?:gomp|omp|iomp5?)(?:[-.][^/ \n]*)?\.so[^/ \n]*)$", re.MULTILINE)
_pausers: dict[str, Callable[[int], int]] = {}
_warned = False
_scanned: tuple[int, list[str]] = (-1, [])  # (len(sys.modules) when scanned, runtimes found)


def wanted_threads(nprocs: int, environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """Threads per worker: the user's ``OMP_NUM_THREADS`` when it is a number, else usable cores // nprocs,
    at least 1."""
    user = environ.get("OMP_NUM_THREADS", "")
    if user.isdigit():
        return max(1, int(user))
    return max(1, usable_cpu_count() // nprocs)


def _loaded_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, from ``/proc/self/maps``."""
    try:
        with open(maps) as file:
            text = file.read()
    except OSError:
        return []
    return list(dict.fromkeys(_RUNTIME_PATH.findall(text)))


def _pauser(path: str) -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of an already loaded runtime (``RTLD_NOLOAD``: never loads one)."""
    if path not in _pausers:
        try:
            library: Any = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            function = library.omp_pause_resource_all
        except (OSError, AttributeError):
            return None
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        _pausers[path] = function
    return _pausers[path]


def release_openmp_pools() -> bool:
    """Free the thread pool of every OpenMP runtime loaded in this process, in the parent, before forking.

    Returns:
        True when no runtime is loaded or every loaded one freed its pool (forked workers may then use
        several threads); False when one could not (the call is missing, or another thread is inside a
        parallel region), in which case a forked worker that runs a parallel region could hang.
    """
    if not sys.platform.startswith("linux"):
        return True
    global _scanned
    if _scanned[0] != len(sys.modules):  # reading /proc/self/maps costs milliseconds: only after new imports
        _scanned = (len(sys.modules), _loaded_runtimes())
    for path in _scanned[1]:
        pause = _pauser(path)
        if pause is None or pause(_OMP_PAUSE_HARD) != 0:
            return False
    return True


def worker_threads(nprocs: int, start_method: str) -> int:
    """Intra-op threads for each worker of a launch, decided in the parent.

    Under ``fork`` the parent's OpenMP pools are released first (see the module docstring); if that fails,
    forked workers get one thread and a one-time ``RuntimeWarning`` pointing at the caller's line says so.
    """
    global _warned
    wanted = wanted_threads(nprocs)
    if start_method != "fork" or wanted == 1 or release_openmp_pools():
        return wanted
    if not _warned:
        _warned = True
        warn_at_user(
            "mplaunch: this process's OpenMP thread pool could not be released before fork (another thread "
            "may be running a parallel torch operation), and GNU OpenMP's pool does not survive fork, so "
            f"forked workers use 1 intra-op thread each instead of {wanted} (else they could hang). Use "
            "start_method='forkserver' or 'spawn' for more.",
            RuntimeWarning,
        )
    return 1
