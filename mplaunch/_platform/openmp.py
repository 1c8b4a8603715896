"""The OpenMP runtimes loaded in this process (found by threadpoolctl, which loads none), and freeing their
thread pools before a fork: a forked child entering a parallel region waits forever for libgomp's pool
threads, which ``fork`` did not copy. OpenMP 5.0's ``omp_pause_resource_all(omp_pause_hard)`` frees them."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from mplaunch._platform.environ import environ_kept

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_scanned: tuple[int, list[Any]] = (-1, [])  # (len(sys.modules) when scanned, the runtimes' libraries)


def loaded_runtimes() -> list[Any]:
    """Return the loaded OpenMP runtimes as ctypes libraries (looked up again only after new imports: 1 ms)."""
    global _scanned
    if _scanned[0] != len(sys.modules):
        with environ_kept():  # threadpoolctl sets KMP_DUPLICATE_LIB_OK when imported; the user did not
            from threadpoolctl import ThreadpoolController

        found = ThreadpoolController().select(internal_api="openmp").lib_controllers
        _scanned = (len(sys.modules), [controller.dynlib for controller in found])
    return _scanned[1]


def release_pools() -> bool:
    """Free every loaded OpenMP runtime's pool before forking; False when one could not (a forked worker may hang)."""
    if not sys.platform.startswith("linux"):
        return True
    for library in loaded_runtimes():
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is None:
            return False
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return False
    return True
